"""The C++ CPU backend (csrc/, torch.ops.fgrpo.*): equality with the float64 reference on awkward
shapes, bitwise determinism across thread counts, FGRPO_CPU_BACKEND and the chunked fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fgrpo_kernels
from fgrpo_kernels import fused_linear_logprobs, reference
from fgrpo_kernels.backends import cpu
from fgrpo_kernels.backends.cpu import chunked, cpp
from fgrpo_kernels.core.options import LogProbOptions
from fgrpo_kernels.head.autograd import LinearLogProbFunction

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ("logp", "entropy", "dhidden", "dweight", "dbias")


@pytest.fixture(autouse=True)
def cpp_backend(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "cpp")


def check(name, got, want, tol):
    if want is None:
        assert got is None, f"{name}: expected no gradient"
        return
    assert got is not None and got.shape == want.shape, f"{name}: shape {got} vs {want.shape}"
    got, want = got.double(), want.double()
    err = ((got - want).norm() / want.norm().clamp_min(floor(name, want))).item()
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def floor(name, want):
    """Outputs near 0 carry fp32's absolute error, not a relative one: the logp of a p ≈ 1
    token (~1e-7·|lse|), a gradient whose logp and entropy terms cancel on one row. Norms are
    floored at 0.1 per element (1e-6 absolute per element at rtol 1e-5)."""
    return 0.1 * want.numel() ** 0.5


def make_inputs(seed, N, H, V, dtype, w_dtype, has_bias, ignore_index, frac_ignored):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 2 / H**0.5).to(w_dtype)
    bias = torch.randn(V, generator=gen).to(w_dtype) if has_bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[torch.rand(N, generator=gen) < frac_ignored] = ignore_index
    upstream = torch.randn(2, N, generator=gen)
    return hidden, weight, targets, bias, upstream


def run(impl, hidden, weight, targets, bias, upstream, tau, ignore_index, *, up=None, frozen=()):
    """(logp, entropy, dhidden, dweight, dbias) of Σ g·logp + Σ g_H·entropy."""
    leaves = [None if t is None else t.detach().to(up or t.dtype) for t in (hidden, weight, bias)]
    for name, t in zip(("hidden", "weight", "bias"), leaves, strict=True):
        if t is not None and name not in frozen:
            t.requires_grad_()
    h, w, b = leaves
    logp, ent = impl(h, w, targets, b, tau, ignore_index, True)
    (upstream[0].to(logp.dtype) * logp + upstream[1].to(ent.dtype) * ent).sum().backward()
    return logp, ent, *(None if t is None else t.grad for t in leaves)


def compare(hidden, weight, targets, bias, upstream, tau, ignore_index, frozen=()):
    got = run(
        fused_linear_logprobs,
        hidden,
        weight,
        targets,
        bias,
        upstream,
        tau,
        ignore_index,
        frozen=frozen,
    )
    want = run(
        reference.logprobs,
        hidden,
        weight,
        targets,
        bias,
        upstream,
        tau,
        ignore_index,
        up=torch.float64,
        frozen=frozen,
    )
    tol = max(TOL[t.dtype] for t in (hidden, weight, bias) if t is not None)
    for name, g, w in zip(OUTPUTS, got, want, strict=True):
        check(name, g, w, tol)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for g, t in zip(got[2:], (hidden, weight, bias), strict=True):
        assert g is None or g.dtype == t.dtype, f"gradient dtype {g.dtype} != input {t.dtype}"


@given(
    seed=st.integers(0, 2**31 - 1),
    N=st.integers(1, 40),
    H=st.integers(1, 70),
    V=st.integers(2, 400),
    dtypes=st.sampled_from(
        [
            (torch.float32,) * 2,
            (torch.bfloat16,) * 2,
            (torch.float16,) * 2,
            (torch.bfloat16, torch.float32),
            (torch.float32, torch.float16),
        ]
    ),
    has_bias=st.booleans(),
    tau=st.sampled_from([1.0, 0.6, 1.7]),
    ignore_index=st.sampled_from([-100, 0]),
    frac_ignored=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_matches_float64_reference(
    seed, N, H, V, dtypes, has_bias, tau, ignore_index, frac_ignored
):
    inputs = make_inputs(seed, N, H, V, *dtypes, has_bias, ignore_index, frac_ignored)
    compare(*inputs, tau, ignore_index)


@pytest.mark.parametrize("chunks", [(7, 13), (1024, 4096)])
@given(
    seed=st.integers(0, 2**31 - 1),
    N=st.integers(1, 30),
    H=st.integers(1, 40),
    V=st.integers(2, 90),
    dtypes=st.sampled_from([(torch.float32,) * 2, (torch.bfloat16, torch.float32)]),
    has_bias=st.booleans(),
)
def test_chunked_fallback_matches_float64_reference(
    monkeypatch, chunks, seed, N, H, V, dtypes, has_bias
):
    """The chunked-PyTorch path (FGRPO_CPU_BACKEND=torch) against the same float64 oracle,
    with small chunks too so that several token and vocab chunks are exercised."""
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")
    monkeypatch.setattr(chunked, "TOKEN_CHUNK", chunks[0])
    monkeypatch.setattr(chunked, "VOCAB_CHUNK", chunks[1])
    inputs = make_inputs(seed, N, H, V, *dtypes, has_bias, -100, 0.3)
    compare(*inputs, 0.8, -100)


@pytest.mark.parametrize(
    "N, H, V, dtype, has_bias, tau",
    [
        (1, 1, 2, torch.float32, False, 1.0),  # the smallest problem
        (1, 33, 257, torch.float32, True, 0.7),  # N = 1, V one past a tile
        (300, 17, 513, torch.float32, True, 1.3),  # two token blocks, three vocab tiles
        (40, 24, 2100, torch.float32, True, 0.8),  # three backward vocab sweeps
        (2 * 4096 + 37, 8, 257, torch.float32, True, 1.0),  # three backward token chunks
        (257, 65, 1100, torch.bfloat16, True, 2.0),
        (5, 130, 1000, torch.float16, False, 0.5),
    ],
)
def test_named_shapes(N, H, V, dtype, has_bias, tau):
    compare(*make_inputs(N + V, N, H, V, dtype, dtype, has_bias, -100, 0.2), tau, -100)


@pytest.mark.parametrize("frozen", [("weight",), ("hidden",), ("hidden", "bias")])
def test_frozen_inputs(frozen):
    compare(
        *make_inputs(7, 29, 19, 333, torch.float32, torch.float32, True, -100, 0.2),
        1.1,
        -100,
        frozen=frozen,
    )


def test_fp64_goes_to_chunked():
    h, w, y, b, g = make_inputs(3, 13, 9, 77, torch.float64, torch.float64, True, -100, 0.2)
    opts = LogProbOptions(0.9, -100)
    got = cpp.logprob_fwd(h, w, y, b, opts, True)
    want = chunked.logprob_fwd(h, w, y, b, opts, True)
    same = all(torch.equal(a, e) for a, e in zip(got, want, strict=True))
    assert same, "fp64 forward differs from chunked"
    assert got[0].dtype == torch.float64


def _all_outputs(dtype, threads):
    h, w, y, b, g = make_inputs(11, 700, 96, 1300, dtype, dtype, True, -100, 0.1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run(fused_linear_logprobs, h, w, y, b, g, 0.8, -100)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_deterministic_across_thread_counts(dtype):
    one = _all_outputs(dtype, 1)
    for threads in (2, 3):
        other = _all_outputs(dtype, threads)
        for name, a, b in zip(OUTPUTS, one, other, strict=True):
            assert torch.equal(a, b), f"{name}: 1 vs {threads} threads differ"


def test_ops_trace_under_torch_compile():
    torch._dynamo.reset()
    h, w, y, b, g = make_inputs(5, 21, 16, 50, torch.float32, torch.float32, True, -100, 0.2)
    opts = LogProbOptions(0.9, -100)

    def loss(h, w, b):
        logp, ent = LinearLogProbFunction.apply(h, w, y, b, opts, True)
        return (g[0] * logp + g[1] * ent).sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for name, a, e in zip(("dhidden", "dweight", "dbias"), *grads, strict=True):
        assert torch.equal(a, e), f"{name}: compiled differs from eager"


def test_public_function_compiles_onto_the_ops():
    """torch.compile of fused_linear_logprobs: the targets range check of the validation is a
    graph break (data-dependent); the graph after it holds the fgrpo ops, fwd and bwd."""
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    seen = []

    def record(gm, _):
        seen.append(gm.code)
        return gm.forward

    h, w, y, b, g = make_inputs(6, 19, 12, 70, torch.float32, torch.float32, True, -100, 0.2)

    def loss(h, w, b):
        logp, ent = fused_linear_logprobs(h, w, y, b, 0.7, -100, True)
        return (g[0] * logp + g[1] * ent).sum()

    compiled = torch.compile(loss, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    grads = []
    for fn in (loss, compiled):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for name, a, e in zip(("dhidden", "dweight", "dbias"), *grads, strict=True):
        assert torch.equal(a, e), f"{name}: compiled differs from eager"
    code = "\n".join(seen)
    assert "fgrpo.logprob_fwd" in code and "fgrpo.logprob_bwd" in code, code


def test_constant_mark_is_the_one_torch_sets():
    """cpp.available carries torch.compiler.assume_constant_result's mark, set without importing
    torch._dynamo (which, after init_process_group, pins the default group)."""
    from fgrpo_kernels.backends.cpu import cpp

    def probe():
        return True

    def ours():
        return True

    before = set(vars(probe))
    marked = torch.compiler.assume_constant_result(probe)
    want = {k: v for k, v in vars(marked).items() if k not in before}
    assert want, "torch's assume_constant_result sets no attribute any more"
    got = vars(cpp.constant_under_compile(ours))
    assert {k: got.get(k) for k in want} == want
    assert all(getattr(cpp.available, k, None) == v for k, v in want.items())


def test_fake_kernels_match_real_ones():
    h, w, y, b, g = make_inputs(2, 9, 8, 40, torch.bfloat16, torch.bfloat16, True, -100, 0.2)
    torch.library.opcheck(torch.ops.fgrpo.logprob_fwd.default, (h, w, y, b, 0.9, -100, True))
    logp, lse, ent = torch.ops.fgrpo.logprob_fwd(h, w, y, b, 0.9, -100, True)
    for args in [
        (b, lse, ent, g[0], g[1], 0.9, -100, True, True, True),
        (None, lse, None, g[0], None, 1.0, -100, False, True, False),
    ]:
        torch.library.opcheck(torch.ops.fgrpo.logprob_bwd.default, (h, w, y, *args))


# ----------------------------------------------------------------------------- backend choice


def test_cpu_backend_names(monkeypatch):
    assert fgrpo_kernels.cpu_backend() == "cpp" and cpu.backend_module() is cpp
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")
    assert fgrpo_kernels.cpu_backend() == "torch" and cpu.backend_module() is chunked
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "fast")
    with pytest.raises(ValueError, match="FGRPO_CPU_BACKEND"):
        fgrpo_kernels.cpu_backend()


@pytest.fixture
def failing_build(monkeypatch):
    def no_compiler():
        raise RuntimeError("simulated: no C++ compiler")

    monkeypatch.setattr(cpp, "_state", {})
    monkeypatch.setattr(cpp, "_build_and_load", no_compiler)
    monkeypatch.setattr(cpu, "_fallback_warned", False)


def test_failed_build_falls_back_with_one_warning(monkeypatch, failing_build):
    monkeypatch.delenv("FGRPO_CPU_BACKEND")
    h, w, y, b, g = make_inputs(1, 12, 10, 50, torch.float32, torch.float32, True, -100, 0.2)
    with pytest.warns(RuntimeWarning, match="chunked-PyTorch") as record:
        assert fgrpo_kernels.cpu_backend() == "torch"
        got = run(fused_linear_logprobs, h, w, y, b, g, 1.0, -100)
    assert len([r for r in record if "C++ CPU backend" in str(r.message)]) == 1
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")
    want = run(fused_linear_logprobs, h, w, y, b, g, 1.0, -100)
    same = all(torch.equal(a, e) for a, e in zip(got, want, strict=True))
    assert same, "the fallback is not the chunked path"


def test_forced_cpp_without_build_is_an_error(failing_build):
    with pytest.raises(RuntimeError, match="FGRPO_CPU_BACKEND=cpp.*no C\\+\\+ compiler"):
        fgrpo_kernels.cpu_backend()


def test_forced_torch_never_builds(monkeypatch, failing_build):
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fgrpo_kernels.cpu_backend() == "torch"
    assert cpp.build_error() is None and "error" not in cpp._state


def test_real_build_failure_in_a_fresh_process(tmp_path):
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-compiler"),
        TORCH_EXTENSIONS_DIR=str(tmp_path),
        FGRPO_BACKEND="cpu",
        PYTHONPATH=str(ROOT),
    )
    env.pop("FGRPO_CPU_BACKEND", None)
    code = (
        "import warnings, torch, fgrpo_kernels as f\n"
        "warnings.simplefilter('always')\n"
        "h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])\n"
        "f.fused_linear_logprobs(h, w, y); f.fused_linear_logprobs(h, w, y)\n"
        "print(f.cpu_backend())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch", out.stdout
    assert out.stderr.count("could not be built") == 1, out.stderr


def test_regression_near_certain_token_logp_is_absolutely_accurate():
    """Bug report from CI: N = 1, H = 1, V = 2 with a large logit gap gives logp ≈ −5e-5, whose
    fp32 value (like torch's own log_softmax in fp32) is only absolutely accurate, ~1e-7."""
    h = torch.tensor([[3.0]])
    w = torch.tensor([[3.3], [0.0]])
    y = torch.tensor([0])
    got = fused_linear_logprobs(h, w, y)
    want = reference.logprobs(h.double(), w.double(), y)
    assert abs(float(got) - float(want)) < 1e-6
    assert float(want) > -1e-3
