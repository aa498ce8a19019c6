"""Every peer adapter of `fgrpo bench` does the same work: at toy size its log-probs, losses and
gradients equal a float64 oracle, so a peer's row measures what ours measures. Also: a missing
peer is a row, the presets list what the issue asks, the whole-step variants compute one loss."""

from __future__ import annotations

import sys

import pytest
import torch

from fgrpo_kernels import reference
from fgrpo_kernels.benchmarks import measure
from fgrpo_kernels.benchmarks.peers import PEERS
from fgrpo_kernels.benchmarks.presets import PRESETS, Case, Policy
from fgrpo_kernels.benchmarks.workload import FGRPO_BETA, GRPO_BETA, Workload, run_step

# peer: the module its adapter imports (skipped where the peer is not installed)
NEEDS = {
    "liger": "liger_kernel",
    "cce": "cut_cross_entropy",
    "trl": "trl.kernels",
    "verl": "verl.utils.experimental.torch_functional",
}
CPU_PEERS = [name for name, peer in PEERS.items() if "cpu" in peer.devices]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")  # the CPU path a user gets, not the interpreter


def toy(pass_="fwd+bwd", B=3, T=7, H=24, V=1031, workload="logprobs", impl="ours") -> Case:
    return Case(impl, workload, pass_, B * T, V, H, "float32", "cpu", B, Policy())


def oracle(w: Workload, workload: str) -> torch.Tensor:
    """float64: the log-probs from materialised logits, and the losses on them."""
    h, W = w.hidden.detach().double().requires_grad_(), w.weight.detach().double()
    W.requires_grad_(w.weight.requires_grad)
    logps = torch.log_softmax(h @ W.T, -1).gather(-1, w.ids[..., None])[..., 0]
    ref, adv, mask = w.ref_logps.double(), w.advantages.double(), w.mask.double()
    if workload == "grpo":
        out = reference.grpo_loss(logps, None, ref, adv, mask, "dapo", GRPO_BETA)
    elif workload == "fgrpo":
        out = reference.fgrpo_loss(logps, ref, adv, mask, "pearson", FGRPO_BETA)
    else:
        out = logps
    out.backward(None if out.dim() == 0 else w.grad_logp.double())
    return out, h.grad, W.grad


def _check(peer: str, workload: str, pass_: str = "fwd+bwd") -> None:
    if peer in NEEDS:
        pytest.importorskip(NEEDS[peer])
    case = toy(pass_, workload=workload, impl=peer)
    w = Workload.make(case)
    out = run_step(PEERS[peer].step(workload, "cpu"), w, pass_)
    want, dh, dw = oracle(w, workload)
    assert out.shape == want.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.detach().double(), want.detach(), rtol=1e-5, atol=1e-5)
    if pass_ == "fwd":
        return
    torch.testing.assert_close(w.hidden.grad.double(), dh, rtol=1e-4, atol=1e-6)
    if pass_ == "fwd+bwd":
        torch.testing.assert_close(w.weight.grad.double(), dw, rtol=1e-4, atol=1e-6)
    else:
        assert w.weight.grad is None


@pytest.mark.parametrize("peer", CPU_PEERS)
def test_peer_logprobs_and_gradients_match_the_oracle(peer):
    _check(peer, "logprobs")


@pytest.mark.parametrize("peer", [p for p in CPU_PEERS if PEERS[p].runs("grpo") and p != "compile"])
@pytest.mark.parametrize("pass_", ["fwd+bwd", "fwd+bwd-frozen"])
def test_peer_grpo_loss_matches_the_oracle(peer, pass_):
    _check(peer, "grpo", pass_)


@pytest.mark.parametrize("peer", ["eager", "ours"])
def test_peer_fgrpo_loss_matches_the_oracle(peer):
    _check(peer, "fgrpo")


def test_forward_pass_takes_no_graph():
    w = Workload.make(toy("fwd"))
    out = run_step(PEERS["ours"].step("logprobs", "cpu"), w, "fwd")
    assert not out.requires_grad and w.hidden.grad is None


def test_prefix_warmup_keeps_the_batch():
    w = Workload.make(toy(B=4, T=16))
    p = w.prefix()
    assert p.hidden.shape == (4, 2, 24) and p.ids.shape == (4, 2) and p.weight is w.weight
    assert p.hidden.is_leaf and p.hidden.requires_grad and p.ids.is_contiguous()
    torch.testing.assert_close(p.ref_logps, w.ref_logps[:, :2])


def test_missing_peer_is_an_unavailable_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)  # import → ImportError
    result = measure.measure(toy(impl="cce"), "none")
    assert result["status"] == "unavailable", result
    assert "cut-cross-entropy is not installed" in result["note"]
    assert "fgrpo-kernels[bench]" in result["note"]


def test_missing_peer_without_an_extra_says_where_to_look(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)
    monkeypatch.setitem(sys.modules, "verl.utils.experimental.torch_functional", None)
    result = measure.measure(toy(impl="verl"), "none")
    assert result["status"] == "unavailable" and "see the README" in result["note"]


def test_quick_preset_lists_every_peer_and_ours_to_65536():
    cases = PRESETS["cpu-quick"].cases()
    assert {c.impl for c in cases} == {"eager", "compile", "liger", "cce", "trl", "verl", "ours"}
    assert max(c.tokens for c in cases if c.impl == "ours") == 65536
    assert {c.workload for c in cases if c.impl == "ours"} == {"logprobs", "grpo"}
    assert PRESETS["cpu-quick"].policy.max_mem_gib is not None  # oom rows, not swapping


def test_long_preset_reaches_131072_for_single_sequences_and_groups():
    cases = PRESETS["cpu-long"].cases()
    big = {(c.impl, c.generations) for c in cases if c.tokens == 131072}
    assert {("ours", 1), ("ours", 8), ("eager", 1), ("eager", 8), ("cce", 1)} <= big
    assert {c.impl for c in cases} >= {"liger", "trl", "verl", "compile"}
    assert PRESETS["cpu-long"].policy.max_mem_gib is not None


def test_train_memory_preset_is_qwen2_vocab_4k_to_32k_tokens_per_sequence():
    cases = PRESETS["train-memory"].cases()
    assert {c.impl for c in cases} == {"backbone", "trl", "trl_liger", "ours"}
    assert {c.vocab for c in cases} == {151936}
    assert {c.seq_len for c in cases} == {4096, 16384, 32768}


@pytest.mark.parametrize(
    "vllm_is,bias_kl", [(None, False), ("sequence_mask", True), ("token_truncate", False)]
)
def test_train_step_variants_compute_one_loss(vllm_is, bias_kl):
    pytest.importorskip("trl")
    pytest.importorskip("liger_kernel")
    from fgrpo_kernels.benchmarks.train_step import TrainStepJob

    grads, losses = {}, {}
    for impl in ("trl", "trl_liger", "ours"):
        case = Case(impl, "train-step", "fwd+bwd", 2 * 24, 301, 16, "float32", "cpu", 2, Policy(),
                    vllm_is=vllm_is, bias_correction_kl=bias_kl)  # fmt: skip
        job = TrainStepJob(case)
        losses[impl] = job.run()
        grads[impl] = job.model.lm_head.weight.grad.clone()
        job.reset()
        assert job.model.lm_head.weight.grad is None
    for impl in ("trl_liger", "ours"):
        assert losses[impl] == pytest.approx(losses["trl"], rel=1e-5), losses
        torch.testing.assert_close(grads[impl], grads["trl"], rtol=1e-4, atol=1e-7)
