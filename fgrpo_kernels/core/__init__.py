"""The maths, with no kernel: validation, the divergence table, the option types, the GRPO
per-token formulas and the plain-PyTorch reference of every loss (the CPU oracle)."""
