"""The single pass (gradients formed in the forward sweep) against the two-pass path.

Every module, loss type and level, on the C++, chunked-PyTorch and interpreted Triton backends,
with chunks of a drawn number of rows: token-level losses split anywhere, while a loss that
needs whole sequences or groups must fall back to the two-pass path exactly when a chunk would
cut one (asserted through the module's `last_pass`). Loss and gradients agree to fp32's 1e-5.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fgrpo_kernels as fk
from fgrpo_kernels import reference as R
from fgrpo_kernels.backends import phases
from fgrpo_kernels.backends.cpu import cpp
from fgrpo_kernels.divergences import NAMES
from fgrpo_kernels.head.autograd import select_backend
from fgrpo_kernels.losses import single_pass
from fgrpo_kernels.testing import linear_batches, rel_error

from .epilogue_cases import grpo_options, side_inputs

BACKENDS = ["cpp", "chunked", "triton"]
FP32 = dict(dtypes=(torch.float32,), max_len=7, max_vocab=40)
EXAMPLES = settings(max_examples=8)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "triton" if request.param == "triton" else "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch" if request.param == "chunked" else "cpp")
    monkeypatch.delenv("FGRPO_MAX_CHUNK_BYTES", raising=False)
    if request.param == "cpp" and not cpp.available():
        pytest.skip(f"C++ backend not built: {cpp.build_error()}")
    return request.param


def chunk_bytes(lb, rows: int) -> int:
    """max_chunk_bytes that makes chunks of exactly `rows` rows on the current backend."""
    backend = select_backend(lb.hidden.device)
    return rows * backend.bytes_per_row(lb.hidden.reshape(-1, lb.hidden.shape[-1]), len(lb.weight))


def run(make, call, lb, max_chunk_bytes):
    """(module, loss, d loss/d(hidden, weight[, bias])) of one call on fresh leaves."""
    leaves = [lb.hidden, lb.weight] + ([] if lb.bias is None else [lb.bias])
    ins = [t.clone().requires_grad_(True) for t in leaves]
    module = make(max_chunk_bytes)
    loss = call(module, ins[0], ins[1], ins[2] if lb.bias is not None else None)[0]
    return module, loss.detach(), torch.autograd.grad(loss, ins)


def open_rows_fit(lb, rows: int) -> bool:
    """Whether the open row's fp32 dW (and db) fits in half of the budget of `rows` rows and
    leaves room for one row of logits (`single_pass._open_rows`)."""
    budget = chunk_bytes(lb, rows)
    V, H = lb.weight.shape
    open_bytes = V * (H + (lb.bias is not None)) * 4
    return 2 * open_bytes <= budget and budget - open_bytes >= chunk_bytes(lb, 1)


def unit_reason(lb, locality: str, rows: int, G: int = 1, scaled: bool = False) -> str | None:
    """None when a chunk of `rows` rows holds every unit of `locality` (or, for a loss whose
    rows are `scaled`, when open rows fit), else the start of the fallback's reason."""
    lengths = lb.batch.mask.sum(-1)
    if locality == "token":
        return None
    if locality == "row":
        if scaled and open_rows_fit(lb, rows):
            return None
        return None if int(lengths.max()) <= rows else "a sequence holds"
    what = "a sequence holds" if G == 1 else f"a group of {G}"
    return None if int(lengths.reshape(-1, G).sum(-1).max()) <= rows else what


def assert_same(make, call, lb, rows, reason, label, passes=lambda m: [m]):
    """The single pass with chunks of `rows` rows equals the two-pass path; `reason` None: it
    must run (every module of `passes(module)`), else the fallback must, with that reason."""
    _, want, want_grads = run(make, call, lb, 0)
    module, got, grads = run(make, call, lb, chunk_bytes(lb, rows))
    for m, why in zip(passes(module), reason if isinstance(reason, list) else [reason]):
        if why is None:
            assert m.last_pass == "single", f"{label}: {m.last_pass}"
        else:
            assert m.last_pass.startswith(f"two-pass: {why}"), f"{label}: {m.last_pass}"
    errs = {"loss": rel_error(got, want, 1e-3)}
    for name, g, w in zip(("hidden", "weight", "bias"), grads, want_grads):
        errs[f"d/d{name}"] = rel_error(g, w, 1e-6)
    assert max(errs.values()) <= 1e-5, f"{label}: {errs}"


def fp32(t):
    return None if t is None else t.float()


@EXAMPLES
@given(
    lb=linear_batches(**FP32),
    opts=grpo_options(),
    ratio=st.sampled_from([None, "token", "row", "flat"]),
    no_old=st.booleans(),
    n_items=st.sampled_from([None, 7]),
    entropy=st.booleans(),
    rows=st.integers(1, 12),
)
def test_grpo_family(backend, lb, opts, ratio, no_old, n_items, entropy, rows):
    b = lb.batch
    rho, _, sampling = side_inputs(b, ratio, 0)
    old = None if no_old else b.old_logps

    def make(max_chunk_bytes):
        return fk.FusedLinearGRPOLoss(**opts, compute_entropy=entropy,
                                      max_chunk_bytes=max_chunk_bytes)  # fmt: skip

    def call(module, h, w, bias):
        return module(h, w, lb.completion_ids, b.mask, b.advantages, bias,
                      ref_per_token_logps=b.ref_logps, old_per_token_logps=old,
                      vllm_is_ratio=fp32(rho), sampling_per_token_logps=fp32(sampling),
                      num_items_in_batch=n_items)  # fmt: skip

    # on-policy (no old log-probs) GSPO's ratio is 1 whatever the other tokens: token-local
    gspo = opts["importance_sampling_level"] == "sequence" and not no_old
    per_row = (gspo or opts["loss_type"] == "vespo"
               or opts["off_policy_mask_threshold"] is not None)  # fmt: skip
    scaled = (opts["importance_sampling_level"] == "sequence" and opts["loss_type"] != "vespo"
              and opts["off_policy_mask_threshold"] is None and opts["beta"] == 0.0
              and opts.get("entropy_coef", 0.0) == 0.0)  # fmt: skip
    reason = unit_reason(lb, "row" if per_row else "token", rows, scaled=scaled)
    if opts["top_entropy_quantile"] < 1.0:
        reason = "top_entropy_quantile < 1"
    assert_same(make, call, lb, rows, reason, f"GRPO {opts} {backend}")


@EXAMPLES
@given(
    lb=linear_batches(**FP32),
    div=st.sampled_from(NAMES),
    level=st.sampled_from(R.LEVELS),
    data=st.data(),
    rewards_in=st.booleans(),
    is_weights=st.booleans(),
    given_old=st.booleans(),
    ratio=st.sampled_from([None, "token", "row", "flat"]),
    coef=st.sampled_from([0.0, 0.1]),
    rows=st.integers(1, 12),
)
def test_fgrpo(backend, lb, div, level, data, rewards_in, is_weights, given_old, ratio, coef,
               rows):  # fmt: skip
    b = lb.batch
    G = b.num_generations
    red = data.draw(st.sampled_from(R.REDUCTIONS[level]), label="reduction")
    scale = data.draw(st.sampled_from(R.SCALES), label="scale") if rewards_in else "group"
    if level == "sequence" and ratio == "token":
        ratio = "row"
    rho, _, _ = side_inputs(b, ratio, 1)
    kwargs = {"rewards": b.rewards} if rewards_in else {"advantages": b.advantages}
    if is_weights:
        kwargs["rewards"] = b.rewards
        kwargs["old_per_token_logps"] = b.old_logps if given_old else None

    def make(max_chunk_bytes):
        return fk.FusedLinearFGRPOLoss(
            div, 0.2, level, red, num_generations=G, scale_rewards=scale,
            group_is_weights=is_weights, entropy_coef=coef, max_chunk_bytes=max_chunk_bytes,
        )  # fmt: skip

    def call(module, h, w, bias):
        return module(h, w, lb.completion_ids, b.mask, ref_per_token_logps=b.ref_logps,
                      bias=bias, vllm_is_ratio=fp32(rho), **kwargs)  # fmt: skip

    locality = "group" if is_weights else "row" if level == "sequence" else "token"
    reason = unit_reason(lb, locality, rows, G, scaled=coef == 0.0)
    assert_same(make, call, lb, rows, reason, f"f-GRPO {div} {level} {red} {backend}")


@EXAMPLES
@given(lb=linear_batches(**FP32), detach=st.booleans(), rows=st.integers(1, 24))
def test_gift(backend, lb, detach, rows):
    b = lb.batch
    G = b.num_generations

    def make(max_chunk_bytes):
        return fk.FusedLinearGIFTLoss(G, 0.7, detach_stats=detach, max_chunk_bytes=max_chunk_bytes)

    def call(module, h, w, bias):
        return module(h, w, lb.completion_ids, b.mask, b.rewards, b.ref_logps, bias=bias)

    reason = unit_reason(lb, "group", rows, G)
    assert_same(make, call, lb, rows, reason, f"GIFT detach={detach} {backend}")


@EXAMPLES
@given(lb=linear_batches(**FP32), div=st.sampled_from(NAMES), rows=st.integers(1, 12))
def test_fdo_and_fhal(backend, lb, div, rows):
    b = lb.batch
    G = b.num_generations
    reason = unit_reason(lb, "row", rows, scaled=True)

    def make_fdo(max_chunk_bytes):
        return fk.FusedLinearFDOLoss(div, 0.3, max_chunk_bytes=max_chunk_bytes)

    def call_fdo(module, h, w, bias):
        return module(h, w, lb.completion_ids, b.mask, b.chosen, b.ref_logps, bias=bias)

    assert_same(make_fdo, call_fdo, lb, rows, reason, f"FDO {div} {backend}")

    def make_fhal(max_chunk_bytes):
        return fk.FusedLinearFHALLoss(div, 0.3, 0.4, num_generations=G,
                                      max_chunk_bytes=max_chunk_bytes)  # fmt: skip

    def call_fhal(module, h, w, bias):
        # the preference batch: the same hidden states, read backwards
        return module(h, w, lb.completion_ids, b.mask, h.flip(0), lb.completion_ids.flip(0),
                      b.mask.flip(0), b.chosen, advantages=b.advantages,
                      ref_per_token_logps=b.ref_logps, pref_ref_per_token_logps=b.old_logps,
                      bias=bias)  # fmt: skip

    assert_same(make_fhal, call_fhal, lb, rows, [None, reason], f"f-HAL {div} {backend}",
                passes=lambda m: [m, m.fdo])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_two_pass(backend, dtype):
    """bf16/fp16 inputs: the chunk's logits in fp32, the dlogits in the operand dtype (fp16
    scaled by a power of two), as the two-pass backward's strips."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, V = 4, 6, 16, 70
    lb = type("LB", (), {})()
    lb.hidden = torch.randn(B, T, H, generator=gen).to(dtype)
    lb.weight = (torch.randn(V, H, generator=gen) / 4).to(dtype)
    lb.bias = None
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.2
    ref = -3 * torch.rand(B, T, generator=gen)

    def make(max_chunk_bytes):
        return fk.FusedLinearGRPOLoss("grpo", 0.04, max_chunk_bytes=max_chunk_bytes)

    def call(module, h, w, bias):
        # a mean-style gradient: fp16 dlogits would fall into the subnormals unscaled
        return module(h, w, ids, mask, torch.linspace(-1, 1, B), bias, ref_per_token_logps=ref)

    _, want, want_grads = run(make, call, lb, 0)
    module, got, grads = run(make, call, lb, chunk_bytes(lb, 5))
    assert module.last_pass == "single"
    assert rel_error(got, want) < 1e-5
    for g, w in zip(grads, want_grads):
        assert g.dtype == dtype and rel_error(g, w) < 2e-2


# ----------------------------------------------------------------------------- which path runs


def grpo_call(module, requires_grad=True, **kwargs):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 4, generator=gen, requires_grad=requires_grad)
    w = torch.randn(9, 4, generator=gen, requires_grad=requires_grad)
    ids = torch.randint(0, 9, (2, 3), generator=gen)
    return module(h, w, ids, torch.ones(2, 3), torch.tensor([1.0, -1.0]), **kwargs), (h, w)


@pytest.mark.parametrize(
    "make, kwargs, why",
    [
        (lambda: fk.FusedLinearGRPOLoss(beta=0.0), {}, "single"),
        (lambda: fk.FusedLinearGRPOLoss(beta=0.0, max_chunk_bytes=0), {},
         "two-pass: max_chunk_bytes=0"),
        (lambda: fk.FusedLinearGRPOLoss(beta=0.0, max_chunk_bytes=35), {},
         "two-pass: one row of logits"),
        (lambda: fk.FusedLinearGRPOLoss(beta=0.0, entropy_coef=0.1), {"return_entropy": True},
         "two-pass: return_entropy=True"),
        (lambda: fk.FusedLinearGRPOLoss(beta=0.0, top_entropy_quantile=0.5), {},
         "two-pass: top_entropy_quantile < 1"),
    ],
)  # fmt: skip
def test_last_pass_says_which_path_ran_and_why(backend, make, kwargs, why):
    module = make()
    grpo_call(module, **kwargs)
    assert module.last_pass.startswith(why), module.last_pass


def test_forward_alone_takes_one_pass(backend):
    module = fk.FusedLinearGRPOLoss(beta=0.0)
    with torch.no_grad():
        grpo_call(module)
    assert module.last_pass.startswith("two-pass: no gradient is wanted")
    grpo_call(module, requires_grad=False)
    assert module.last_pass.startswith("two-pass: no gradient is wanted")


def test_environment_sets_the_default_budget(backend, monkeypatch):
    monkeypatch.setenv("FGRPO_MAX_CHUNK_BYTES", "0")
    module = fk.FusedLinearGRPOLoss(beta=0.0)
    grpo_call(module)
    assert module.last_pass == "two-pass: max_chunk_bytes=0"
    grpo_call(fk.FusedLinearGRPOLoss(beta=0.0, max_chunk_bytes=1 << 20))  # the argument wins
    monkeypatch.setenv("FGRPO_MAX_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="^FGRPO_MAX_CHUNK_BYTES: expected a number of bytes"):
        grpo_call(module)


def test_triton_mixed_dtypes_take_the_two_pass_path(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "triton")
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 4, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(9, 4, generator=gen, requires_grad=True)
    module = fk.FusedLinearGRPOLoss(beta=0.0)
    loss, _ = module(h, w, torch.randint(0, 9, (2, 3), generator=gen), torch.ones(2, 3),
                     torch.tensor([1.0, -1.0]))  # fmt: skip
    loss.backward()
    assert module.last_pass.startswith("two-pass: hidden torch.bfloat16 and weight torch.float32")


@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_max_chunk_bytes_is_named(value, error):
    with pytest.raises(error, match="^max_chunk_bytes: expected"):
        fk.FusedLinearGRPOLoss(max_chunk_bytes=value)


# ----------------------------------------------------------------------------- the gradients


def test_gradients_are_handed_over_without_a_copy(backend):
    """The stored gradients are released before `.grad` takes them: the weight's gradient is
    the very tensor the forward formed (no second [V, H] at the end of backward)."""
    seen = {}
    sweep_run = single_pass.run

    def spy(*args, **kwargs):
        value = sweep_run(*args, **kwargs)
        seen["node"] = value[0].grad_fn
        return value

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(single_pass, "run", spy)
    try:
        module = fk.FusedLinearGRPOLoss(beta=0.0)
        (loss, _), (h, w) = grpo_call(module)
        ptr = seen["node"].saved_tensors[4].data_ptr()
        loss.backward()
    finally:
        monkeypatch.undo()
    assert w.grad.data_ptr() == ptr


def test_backward_twice_with_retain_graph_and_scaled_upstream(backend):
    """Regression: gradcheck backpropagates twice through one graph; the first design handed
    the gradients out once and failed there. A later backward returns copies (the first one's
    results are the stored tensors themselves); an upstream gradient ≠ 1 on the first backward
    scales them in place, after which a second backward is a clear error."""
    module = fk.FusedLinearGRPOLoss(beta=0.0)
    (loss, _), (h, w) = grpo_call(module)
    first = [g.clone() for g in torch.autograd.grad(loss, (h, w), retain_graph=True)]
    half = torch.autograd.grad(0.5 * loss, (h, w), retain_graph=True)
    again = torch.autograd.grad(loss, (h, w), retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert all(torch.allclose(a, 0.5 * b) for a, b in zip(half, first))
    (loss, _), (h, w) = grpo_call(module)
    torch.autograd.grad(2.0 * loss, (h, w), retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated a second time after a backward"):
        torch.autograd.grad(loss, (h, w))


def test_double_backward_is_a_clear_error(backend):
    module = fk.FusedLinearGRPOLoss(beta=0.0)
    (loss, _), (h, w) = grpo_call(module)
    (g,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match="higher-order gradients are not supported"):
        torch.autograd.grad(g.sum(), w)


# ----------------------------------------------------------------------------- memory

CHILD = r"""
import json, sys, torch
import fgrpo_kernels as fk
from fgrpo_kernels.benchmarks.process_memory import PeakRSS

N, V, H, B = 8192, 32768, 64, 8
torch.manual_seed(0)
h = torch.randn(B, N // B, H, requires_grad=True)
w = (torch.randn(V, H) / H**0.5).requires_grad_(True)
ids = torch.randint(0, V, (B, N // B))
mask, ref = torch.ones(B, N // B), torch.full((B, N // B), -10.0)
module = fk.FusedLinearGRPOLoss("dapo", 0.04, max_chunk_bytes=int(sys.argv[1]))
fk.cpu_backend()  # the C++ library is loaded once per process, not per call
peak = PeakRSS()
loss, _ = module(h, w, ids, mask, torch.linspace(-1, 1, B), ref_per_token_logps=ref)
loss.backward()
print(json.dumps({"extra_mib": peak.extra() / 2**20, "pass": module.last_pass}))
"""


def peak_of(max_chunk_bytes: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FGRPO_BACKEND")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(max_chunk_bytes)], env=env,
                         capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_memory_is_the_gradients_plus_the_buffer():
    """N 8,192 × V 32,768 × H 64 on the CPU path (one fp32 [N, V] is 1 GiB): with a 16 MiB
    logits buffer the single pass peaks where the two-pass path does with its 16 MiB dlogits
    scratch — the gradients (2 MiB dh, 8 MiB dW), the buffer and a process's fixed overhead
    (~12 MiB here) — never near [N, V]."""
    single, two = peak_of(16 << 20), peak_of(0)
    assert single["pass"] == "single" and two["pass"].startswith("two-pass")
    assert single["extra_mib"] <= two["extra_mib"] + 4, (single, two)
    assert single["extra_mib"] < 64, single


FIRST_CALL = r"""
import json, sys, torch
import fgrpo_kernels as fk

fk.cpu_backend()
h, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
ids = torch.randint(0, 40, (2, 5))
loss, _ = fk.FusedLinearGRPOLoss("dapo", 0.0)(h, w, ids, torch.ones(2, 5), torch.randn(2))
loss.backward()
heavy = ("sympy", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.nn")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "sympy" or m in heavy)))
"""


def test_regression_the_first_call_imports_no_torch_subsystem():
    """`is_dtensor` imported torch.distributed.tensor (sympy, torch.fx: ~70 MiB) on every
    process's first fused call, where test_peak_memory_is_the_gradients_plus_the_buffer counted
    it (84 MiB against its 64), and the C++ backend's load imported torch._dynamo, which after
    init_process_group holds the default group (tests/test_distributed.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FGRPO_BACKEND")}
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ----------------------------------------------------------------------------- open rows

OPEN_B, OPEN_T, OPEN_H, OPEN_V = 4, 13, 3, 23


def open_inputs(seed):
    """(gen, hidden, weight, ids, mask, ref, advantages) on rows of 13, 4, 0 and 11 tokens; `gen`
    draws on after them."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(OPEN_B, OPEN_T, OPEN_H, generator=gen, requires_grad=True)
    w = torch.randn(OPEN_V, OPEN_H, generator=gen, requires_grad=True)
    ids = torch.randint(0, OPEN_V, (OPEN_B, OPEN_T), generator=gen)
    mask = (torch.arange(OPEN_T) < torch.tensor([13, 4, 0, 11])[:, None]).float()
    ref = -3.0 + torch.randn(OPEN_B, OPEN_T, generator=gen)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])
    return gen, h, w, ids, mask, ref, adv


def open_call(kind, max_chunk_bytes):
    """(module, loss, d/d(hidden, weight)) of a GSPO (GRPO at sequence level), sequence-level
    f-GRPO or FDO call on rows of 13, 4, 0 and 11 tokens."""
    gen, h, w, ids, mask, ref, adv = open_inputs(5)
    if kind == "gspo":
        # near-on-policy old log-probs: GSPO's ±0.2 clip on the sequence ratio holds its side
        # as the row goes on (a side that changes costs the row a rerun, tests/test_policy_...)
        logp = torch.log_softmax(h.detach() @ w.detach().T, -1).gather(-1, ids[..., None])[..., 0]
        old = logp + 0.02 * torch.randn(OPEN_B, OPEN_T, generator=gen)
        module = fk.FusedLinearGRPOLoss("grpo", 0.0, importance_sampling_level="sequence",
                                        max_chunk_bytes=max_chunk_bytes)  # fmt: skip
        loss = module(h, w, ids, mask, adv, old_per_token_logps=old)[0]
    elif kind == "fgrpo":
        module = fk.FusedLinearFGRPOLoss("hellinger", 0.2, "sequence", num_generations=2,
                                         max_chunk_bytes=max_chunk_bytes)  # fmt: skip
        loss = module(h, w, ids, mask, advantages=adv, ref_per_token_logps=ref)[0]
    else:
        module = fk.FusedLinearFDOLoss("kl", 0.3, max_chunk_bytes=max_chunk_bytes)
        chosen = torch.tensor([True, False, True, False])
        loss = module(h, w, ids, mask, chosen, ref)[0]
    return module, loss.detach(), torch.autograd.grad(loss, (h, w))


@pytest.mark.parametrize("kind", ["gspo", "fgrpo", "fdo"])
def test_open_rows_of_the_sequence_level_losses(backend, kind):
    """Rows longer than a chunk of 4 rows run as open rows (one fold per long row, no rerun)
    and equal the two-pass path; a long row's earlier pieces take the loss's token part (the
    rows of 13 and 11 tokens: 3 and 2 of them), its last the gradient."""
    budget = OPEN_V * OPEN_H * 4 + 4 * select_backend(torch.device("cpu")).bytes_per_row(
        torch.empty(1, OPEN_H), OPEN_V
    )
    rec = phases.Recorder(cuda=False)
    with phases.recording(rec):
        module, loss, grads = open_call(kind, budget)
    assert module.last_pass == "single"
    assert rec.calls.get("open_row_fold") == 2 and "open_row_rerun" not in rec.calls
    assert rec.calls.get("open_row_part") == 5, rec.calls
    _, want, want_grads = open_call(kind, 0)
    torch.testing.assert_close(loss, want, rtol=2e-5, atol=2e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("ratio_shape", [(OPEN_B, OPEN_T), (OPEN_B, 1)])
def test_regression_open_rows_of_gspo_with_a_vllm_ratio_fold(backend, ratio_shape):
    """GSPO's token part is 1 with a vLLM IS ratio too: ρ_t weighs token t's loss term, a
    function of the sequence ratio, whose gradient is the same on every token (a token part of
    ρ_t, the first one written, missed on per-token ρ and ran the rows again). The long rows
    fold with no rerun and equal the two-pass path."""
    gen, h, w, ids, mask, ref, adv = open_inputs(7)
    h, w = h.detach(), w.detach()
    old = ref + 0.05 * torch.randn(OPEN_B, OPEN_T, generator=gen)
    rho = 0.5 + torch.rand(ratio_shape, generator=gen)
    budget = OPEN_V * OPEN_H * 4 + 4 * select_backend(torch.device("cpu")).bytes_per_row(
        torch.empty(1, OPEN_H), OPEN_V
    )
    out = []
    for max_chunk_bytes in (budget, 0):
        module = fk.FusedLinearGRPOLoss("grpo", 0.0, importance_sampling_level="sequence",
                                        max_chunk_bytes=max_chunk_bytes)  # fmt: skip
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        rec = phases.Recorder(cuda=False)
        with phases.recording(rec):
            loss = module(hh, ww, ids, mask, adv, old_per_token_logps=old, vllm_is_ratio=rho)[0]
        out.append((module.last_pass, dict(rec.calls), loss, *torch.autograd.grad(loss, (hh, ww))))
    assert out[0][0] == "single" and out[0][1].get("open_row_fold") == 2, out[0][1]
    assert "open_row_rerun" not in out[0][1], out[0][1]
    for got, want in zip(out[0][2:], out[1][2:]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_on_policy_gspo_chunks_split_sequences(backend, beta):
    """Without old log-probs GSPO's sequence ratio is 1: chunks of 3 rows split rows of 13 and
    11 tokens with no open row, a β term included, and equal the two-pass path."""
    _, h, w, ids, mask, ref, adv = open_inputs(9)
    h, w = h.detach(), w.detach()
    row = select_backend(torch.device("cpu")).bytes_per_row(torch.empty(1, OPEN_H), OPEN_V)
    out = []
    for budget in (3 * row, 0):
        module = fk.FusedLinearGRPOLoss("dapo", beta, importance_sampling_level="sequence",
                                        max_chunk_bytes=budget)  # fmt: skip
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        rec = phases.Recorder(cuda=False)
        with phases.recording(rec):
            loss = module(hh, ww, ids, mask, adv, ref_per_token_logps=ref)[0]
        out.append((module.last_pass, dict(rec.calls), loss, *torch.autograd.grad(loss, (hh, ww))))
    assert out[0][0] == "single" and "open_row_fold" not in out[0][1]
    for got, want in zip(out[0][2:], out[1][2:]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_regression_equal_rewards_in_a_group_give_the_two_pass_gradient(backend):
    """Found by test_fgrpo at 80 examples: groups of equal rewards (z-scores of rounding over
    σ + eps, ~1e-5) gave a zero gradient on the single pass, whose group statistics were
    float64, and ~1e-5 on the two-pass PyTorch path, whose reference forms them in float32.
    The single pass now forms them as the path that gives the value does."""
    h = torch.tensor([1.5410, -0.2934, -2.1788, 0.5684, -1.0845, -1.3986]).view(6, 1, 1)
    w = torch.tensor([[0.4033], [0.8380]])
    ids = torch.tensor([0, 0, 0, 1, 0, 1]).view(6, 1)
    ref = torch.tensor([-0.0192, -0.0218, -0.0418, -0.0227, -0.0361, -0.0176]).view(6, 1)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0]).view(6, 1)
    rewards = torch.tensor([0.0144] * 3 + [0.4472] * 3)
    out = []
    for max_chunk_bytes in (None, 0):
        module = fk.FusedLinearFGRPOLoss("kl", 0.2, "token", "token_mean", num_generations=3,
                                         max_chunk_bytes=max_chunk_bytes)  # fmt: skip
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = module(hh, ww, ids, mask, ref_per_token_logps=ref, rewards=rewards)[0]
        out.append((module.last_pass, loss, *torch.autograd.grad(loss, (hh, ww))))
    assert out[0][0] == "single" and out[1][0].startswith("two-pass")
    for got, want in zip(out[0][1:], out[1][1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
