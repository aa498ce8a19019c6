"""The backward's TF32 handling: only fp32 GEMMs on CUDA touch the global state, and the
user's setting comes back through the API it was made with (the flags are global, so this
runs on a CPU build too)."""

from __future__ import annotations

import importlib

import pytest
import torch

gemm = importlib.import_module("fgrpo_kernels.backends.triton.gemm")
CUDA = torch.device("cuda")
matmul = torch.backends.cuda.matmul


def legacy():
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return "mixed"


def snapshot():
    return (legacy(), matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision,
            torch.backends.fp32_precision)  # fmt: skip


def allow_tf32_readable():
    try:
        return matmul.allow_tf32
    except RuntimeError as error:
        assert "mix of the legacy and new APIs" in str(error)
        return "raises"


@pytest.fixture(autouse=True)
def default_state():
    """Every test starts from and leaves PyTorch's default state."""

    def reset():
        torch.backends.fp32_precision = "none"
        torch.set_float32_matmul_precision("highest")
        matmul.fp32_precision = "none"
        torch.backends.mkldnn.matmul.fp32_precision = "none"

    reset()
    assert snapshot() == ("highest", "none", "none", "none")
    yield
    reset()


@pytest.fixture
def setters(monkeypatch):
    """Records every call that writes the TF32 state."""
    calls = []
    for name in ("_set_cublas_allow_tf32", "_set_float32_matmul_precision",
                 "_set_fp32_precision_setter"):  # fmt: skip
        real = getattr(torch._C, name)

        def spy(*args, real=real, name=name):
            calls.append(name)
            return real(*args)

        monkeypatch.setattr(torch._C, name, spy)
    return calls


@pytest.mark.parametrize("device, dtype", [(CUDA, torch.bfloat16), (CUDA, torch.float16),
                                           (torch.device("cpu"), torch.float32)])  # fmt: skip
def test_only_fp32_gemms_on_cuda_touch_the_state(setters, device, dtype):
    """Bug: every backward, bf16 included, wrote torch.backends.cuda.matmul.fp32_precision."""
    matmul.allow_tf32 = True  # a legacy user who wants TF32 elsewhere
    setters.clear()
    with gemm.fp32_precision(device, dtype, fast_fp32=False):
        assert matmul.allow_tf32 is True
    assert setters == []


def test_nothing_written_when_the_state_already_fits(setters):
    with gemm.fp32_precision(CUDA, torch.float32, fast_fp32=False):
        assert allow_tf32_readable() is False
    assert setters == [] and snapshot() == ("highest", "none", "none", "none")


LEGACY_USERS = {
    "allow_tf32": lambda: setattr(matmul, "allow_tf32", True),
    "high": lambda: torch.set_float32_matmul_precision("high"),
    "medium": lambda: torch.set_float32_matmul_precision("medium"),
}


@pytest.mark.parametrize("user", sorted(LEGACY_USERS))
def test_regression_legacy_tf32_user_never_sits_in_a_mixed_state(user):
    """Bug: the backward set the per-backend flag over a legacy setting; reading
    `allow_tf32` inside then raised PyTorch's mixed-API error. Now the legacy API turns TF32
    off and `set_float32_matmul_precision` puts the user's precision back."""
    LEGACY_USERS[user]()
    before = snapshot()
    with gemm.fp32_precision(CUDA, torch.float32, fast_fp32=False):
        assert allow_tf32_readable() is False
        assert matmul.fp32_precision == "ieee"
    assert snapshot() == before
    assert allow_tf32_readable() is True


def test_new_api_user_is_restored_through_the_new_api(setters):
    matmul.fp32_precision = "tf32"  # legacy precision still "highest": already mixed
    before = snapshot()
    setters.clear()
    with gemm.fp32_precision(CUDA, torch.float32, fast_fp32=False):
        assert matmul.fp32_precision == "ieee"
    assert set(setters) == {"_set_fp32_precision_setter"}
    assert snapshot() == before and before[1] == "tf32"


def test_fast_fp32_from_the_default_state_leaves_it_exactly():
    with gemm.fp32_precision(CUDA, torch.float32, fast_fp32=True):
        assert allow_tf32_readable() is True
        assert matmul.fp32_precision == "tf32"
    assert snapshot() == ("highest", "none", "none", "none")


def test_global_precision_counts_when_cuda_matmul_defers_to_it():
    torch.backends.fp32_precision = "tf32"  # cuda matmul "none" defers to it
    before = snapshot()
    with gemm.fp32_precision(CUDA, torch.float32, fast_fp32=False):
        assert matmul.fp32_precision == "ieee"
    assert snapshot() == before
