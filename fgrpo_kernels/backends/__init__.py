"""Where the work runs: Triton kernels (`triton/`), the CPU paths (`cpu/`: C++ and chunked
torch), the vocabulary-parallel layout and collectives (`distributed`). Tensors in, tensors out:
nothing here knows a loss."""
