"""Packed (THD) sequences: every fused loss called through `PackedLoss` on hidden [N, H], ids
[N] and cu_seqlens gives the loss, metrics and gradients of the padded [B, T] call, empty
sequences included; bad boundaries are named errors."""

import pytest
import torch

from fgrpo_kernels import (
    FusedLinearFDOLoss,
    FusedLinearFGRPOLoss,
    FusedLinearFHALLoss,
    FusedLinearGIFTLoss,
    FusedLinearGRPOLoss,
    FusedLinearPolicyLoss,
    PackedLoss,
)
from fgrpo_kernels.losses.packed import Layout
from fgrpo_kernels.losses.policy import VARIANTS

H, V = 8, 29
LENGTHS = [3, 0, 5, 1]  # an empty sequence among them


def packed_batch(lengths, seed=0, prefix=""):
    """(cu_seqlens, the packed per-token tensors, the same padded) for `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = {
        f"{prefix}hidden": torch.randn(N, H, generator=gen),
        f"{prefix}completion_ids": torch.randint(0, V, (N,), generator=gen),
        f"{prefix}ref_per_token_logps": -3.0 + 0.3 * torch.randn(N, generator=gen),
    }
    if not prefix:
        packed["old_per_token_logps"] = -3.0 + 0.3 * torch.randn(N, generator=gen)
    layout = Layout.of(cu)
    padded = {k: layout.pad(k, v) for k, v in packed.items()}
    padded[f"{prefix}completion_mask"] = layout.pad("m", torch.ones(N))
    return cu, packed, padded


def leaf(t):
    return t.detach().clone().requires_grad_()


def call_both(make, extra, lengths=LENGTHS, pref=None, keys=None, tokens=None):
    """(packed result, padded result) of module `make()`, checked equal (loss, metrics,
    gradients); `tokens`: more packed per-token inputs."""
    cu, packed, padded = packed_batch(lengths)
    for name, value in (tokens or {}).items():
        packed[name], padded[name] = value, Layout.of(cu).pad(name, value)
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(9))
    keys = (keys or list(packed)) + list(tokens or {})
    if pref is not None:
        pcu, ppacked, ppadded = packed_batch(pref, seed=1, prefix="pref_")
        packed, padded = {**packed, **ppacked}, {**padded, **ppadded}
        keys = keys + list(ppacked)
    results = []
    for inputs, kw in ((packed, {"cu_seqlens": cu}), (padded, {})):
        if pref is not None and kw:
            kw["pref_cu_seqlens"] = pcu
        x = {k: inputs[k] for k in keys}
        x["completion_mask"] = inputs.get("completion_mask")
        if pref is not None:
            x["pref_completion_mask"] = inputs.get("pref_completion_mask")
        x["hidden"], w = leaf(x["hidden"]), leaf(weight)
        module = make()
        out = (PackedLoss(module) if kw else module)(weight=w, **x, **extra, **kw)
        grads = torch.autograd.grad(out[0], (x["hidden"], w))
        results.append((out, grads))
    (p_out, (p_dh, p_dw)), (q_out, (q_dh, q_dw)) = results
    layout = Layout.of(cu)
    torch.testing.assert_close(p_out[0], q_out[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p_dh, layout.unpad(q_dh), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p_dw, q_dw, rtol=1e-5, atol=1e-7)
    for name, value in q_out[1].items():
        torch.testing.assert_close(p_out[1][name], value, rtol=1e-5, atol=1e-7, msg=name)
    return p_out, q_out


ADV = torch.tensor([1.0, -0.5, 0.7, -1.2])
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.25])


def test_grpo(backend):
    call_both(lambda: FusedLinearGRPOLoss("grpo", beta=0.04), {"advantages": ADV})


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fgrpo(backend, level):
    keys = ["hidden", "completion_ids", "ref_per_token_logps"]
    call_both(lambda: FusedLinearFGRPOLoss("kl", 0.1, level), {"advantages": ADV}, keys=keys)


def test_gift(backend):
    keys = ["hidden", "completion_ids", "ref_per_token_logps"]
    call_both(lambda: FusedLinearGIFTLoss(2, 1.0), {"rewards": REWARDS}, keys=keys)


def test_fdo(backend):
    keys = ["hidden", "completion_ids", "ref_per_token_logps"]
    chosen = torch.tensor([True, False, True, False])
    call_both(lambda: FusedLinearFDOLoss("kl", 0.1), {"chosen": chosen}, keys=keys)


def test_fhal_with_its_preference_batch(backend):
    keys = ["hidden", "completion_ids", "ref_per_token_logps"]
    extra = {"chosen": torch.tensor([True, False]), "advantages": ADV}
    call_both(lambda: FusedLinearFHALLoss("kl", 0.1), extra, pref=[2, 4], keys=keys)


@pytest.mark.parametrize("mode", ["gmpo", "vanilla", "clip_cov"])
def test_policy_variants(backend, mode):
    tokens = {}
    if mode == "clip_cov":
        tokens["clip_cov_keep"] = torch.ones(sum(LENGTHS))
        tokens["clip_cov_keep"][2] = 0.0
    keys = ["hidden", "completion_ids", "old_per_token_logps"]
    call_both(lambda: FusedLinearPolicyLoss(mode), {"advantages": ADV}, keys=keys, tokens=tokens)


REST = sorted(set(VARIANTS) - {"gmpo", "vanilla", "clip_cov"})


@pytest.mark.parametrize("mode", REST)
def test_every_other_policy_variant_on_the_cpu(monkeypatch, mode):
    """The variants not run on every backend above, on the chunked-torch path: packed equals
    padded for each entry of `VARIANTS` (sequence-local, batch-wide and token-local alike)."""
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")
    keys = ["hidden", "completion_ids", "old_per_token_logps"]
    options = {"dro_beta": 0.1} if mode == "dro" else {}
    call_both(lambda: FusedLinearPolicyLoss(mode, **options), {"advantages": ADV}, keys=keys)


def test_returned_entropy_comes_back_packed(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    p, q = call_both(lambda: FusedLinearGRPOLoss(beta=0.04), {"advantages": ADV,
                     "return_entropy": True})  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    assert p[2].shape == (sum(LENGTHS),)
    torch.testing.assert_close(p[2], Layout.of(cu).unpad(q[2]))


def test_a_packed_mask_and_a_per_token_ratio_are_laid_out_too(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    cu, packed, padded = packed_batch(LENGTHS)
    w = torch.randn(V, H)
    mask = torch.ones(sum(LENGTHS))
    mask[0] = 0.0
    ratio = torch.rand(sum(LENGTHS)) + 0.5
    layout = Layout.of(cu)
    loss = FusedLinearGRPOLoss(beta=0.0)
    got, _ = PackedLoss(loss)(packed["hidden"], w, packed["completion_ids"], mask, ADV,
                              vllm_is_ratio=ratio, cu_seqlens=cu)  # fmt: skip
    want, _ = loss(padded["hidden"], w, padded["completion_ids"], layout.pad("m", mask), ADV,
                   vllm_is_ratio=layout.pad("r", ratio, 1.0))  # fmt: skip
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("cu", "error", "message"),
    [
        (torch.tensor([0.0, 2.0]), TypeError, "^cu_seqlens: expected an integer tensor"),
        (torch.tensor([1, 3]), ValueError, r"^cu_seqlens: expected \[0, end_1"),
        (torch.tensor([0, 3, 2]), ValueError, "^cu_seqlens: expected non-decreasing"),
        (
            torch.tensor([0, 3, 5]),
            ValueError,
            r"^hidden: expected 5 packed tokens in dim 0 \(cu_seqlens\[-1\]\); got shape \[9, 8\]",
        ),
    ],
)
def test_bad_boundaries_are_named_errors(cu, error, message):
    cu_ok, packed, _ = packed_batch(LENGTHS)
    w = torch.randn(V, H)
    with pytest.raises(error, match=message):
        PackedLoss(FusedLinearGRPOLoss())(packed["hidden"], w, packed["completion_ids"], None,
                                          ADV[:2], cu_seqlens=cu)  # fmt: skip


def test_preference_tokens_need_their_boundaries():
    cu, packed, _ = packed_batch(LENGTHS)
    with pytest.raises(ValueError, match="^pref_cu_seqlens: needed to unpack pref_hidden"):
        PackedLoss(FusedLinearFHALLoss("kl", 0.1))(
            packed["hidden"], torch.randn(V, H), packed["completion_ids"], None,
            torch.randn(3, H), torch.zeros(3, dtype=torch.long), None, torch.tensor([True, False]),
            advantages=ADV, ref_per_token_logps=packed["ref_per_token_logps"],
            pref_ref_per_token_logps=torch.zeros(3), cu_seqlens=cu,
        )  # fmt: skip
