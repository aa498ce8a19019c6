"""Triton kernels: tensors in, tensors out, no autograd."""
