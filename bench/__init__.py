"""Benchmark programs; installed as fgrpo_kernels.bench (see pyproject.toml)."""
