"""The backward's GEMM routes: fp32, cuBLAS out_dtype (CUDA only), the bf16 fallback product
when out_dtype is missing, and the exact upcast (CPU, fp16 fallback)."""

from __future__ import annotations

import importlib

import pytest
import torch

from fgrpo_kernels.backends.triton import configs
from tests.test_logprob_triton import KC, check_against_reference, make_inputs, rel_err

gemm = importlib.import_module("fgrpo_kernels.backends.triton.gemm")


def operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(37, 53, generator=g).to(dtype)
    b = torch.randn(53, 29, generator=g).to(dtype)
    return a, b, a.double() @ b.double()


def test_routes_on_this_machine():
    a32, _, _ = operands(torch.float32)
    a16, _, _ = operands(torch.bfloat16)
    assert gemm.route(a32) == "fp32"
    assert gemm.route(a16) == "upcast"  # CPU tensors: the interpreter's path
    assert gemm.has_out_dtype_mm(torch.device("cpu")) is False  # no CPU kernel for it


@pytest.mark.parametrize("how, dtype, tol", [("fp32", torch.float32, 1e-6),
                                             ("upcast", torch.float16, 1e-6),
                                             ("upcast", torch.bfloat16, 1e-6),
                                             ("bf16", torch.bfloat16, 2**-8)])  # fmt: skip
def test_gemm_writes_then_accumulates_in_fp32(how, dtype, tol):
    a, b, want = operands(dtype)
    out = torch.full((37, 29), float("nan"))
    gemm.gemm(out, a, b, accumulate=False, how=how)
    assert rel_err(out, want) <= tol
    gemm.gemm(out, a, b, accumulate=True, how=how)
    assert out.dtype == torch.float32 and rel_err(out, 2 * want) <= tol


def test_backward_with_the_bf16_fallback_product(monkeypatch):
    """Without cuBLAS's out_dtype overloads a bf16 backward multiplies in bf16 (one bf16
    rounding per tile product, then fp32 accumulation), not through fp32 copies of its
    operands and fp32 GEMMs (~15× slower, silently)."""
    monkeypatch.setenv("FGRPO_BACKEND", "triton")
    routes = []

    def bf16_route(a):
        routes.append("bf16" if a.dtype == torch.bfloat16 else gemm.route(a))
        return routes[-1]

    monkeypatch.setattr(gemm, "route", bf16_route)
    inputs = make_inputs(29, 33, 100, torch.bfloat16, torch.bfloat16, bias=True)
    with configs.forced(KC(16, 16, 16, 1, 1), splits=2, wave=32, chunk=16):
        check_against_reference(inputs, 2e-2, temperature=0.9)
    assert routes and set(routes) == {"bf16"}
