import os

# The Triton kernels are decorated at import time: interpret them on this CPU-only machine.
# FGRPO_BACKEND (read per call) picks between the interpreted Triton path and the CPU path.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# "ci" is derandomized: the same examples on every run, so a red CI is reproducible; "dev"
# explores (HYPOTHESIS_PROFILE=dev).
settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=["chunked", "cpp", "triton"])
def backend(request, monkeypatch):
    """Each of the three paths of a fused call: the chunked-torch CPU backend, the C++ one
    (skipped where it does not build) and the Triton kernels (interpreted here). A test file
    with a `backend` fixture of its own uses that one instead."""
    from fgrpo_kernels.backends.cpu import cpp

    monkeypatch.setenv("FGRPO_BACKEND", "triton" if request.param == "triton" else "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch" if request.param == "chunked" else "cpp")
    if request.param == "cpp" and not cpp.available():
        pytest.skip(f"C++ backend not built: {cpp.build_error()}")
    return request.param
