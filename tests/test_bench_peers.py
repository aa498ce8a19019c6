"""Every peer adapter of `fgrpo bench` does the same work: at toy size its log-probs, losses and
gradients equal a float64 oracle, so a peer's row measures what ours measures. Also: a missing
peer is a row, the presets list what the issue asks, the whole-step variants compute one loss."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from fgrpo_kernels import reference
from fgrpo_kernels.benchmarks import measure, report
from fgrpo_kernels.benchmarks import oracle as bench_oracle
from fgrpo_kernels.benchmarks.peers import PEERS
from fgrpo_kernels.benchmarks.presets import PRESETS, Case, Policy
from fgrpo_kernels.benchmarks.workload import (
    FGRPO_BETA,
    GRPO_BETA,
    VARIANT_WORKLOADS,
    Workload,
    run_step,
)

# peer: the module its adapter imports (skipped where the peer is not installed)
NEEDS = {
    "eager": "trl.trainer.utils",
    "compile": "trl.trainer.utils",
    "liger": "liger_kernel",
    "liger (eager)": "liger_kernel",
    "liger_flce": "liger_kernel",
    "liger_triton": "liger_kernel",
    "cce": "cut_cross_entropy",
    "trl": "trl.kernels",
    "verl": "verl.utils.experimental.torch_functional",
    "verl_triton": "verl.utils.kernel.linear_cross_entropy",
}
# on CPU tensors: the CPU peers, and the Triton ones under the interpreter (conftest sets it);
# Liger's compiled loss (an inductor compile per call shape) is checked by the bench's own rows
CPU_PEERS = [
    name
    for name, peer in PEERS.items()
    if ("cpu" in peer.devices or peer.interpreted) and name != "liger"
]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")  # the CPU path a user gets, not the interpreter


def toy(pass_="fwd+bwd", B=3, T=7, H=24, V=1031, workload="logprobs", impl="ours") -> Case:
    return Case(impl, workload, pass_, B * T, V, H, "float32", "cpu", B, Policy())


def oracle(w: Workload, workload: str, pass_: str = "fwd+bwd"):
    """float64: the log-probs from materialised logits, and the losses on them (the bench's
    own oracle, `oracle.float64`, checked against a transcription here)."""
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
    if not PEERS[peer].runs("logprobs"):
        pytest.skip(f"{peer} has no log-probs of its own")
    _check(peer, "logprobs")


@pytest.mark.parametrize("pass_", ["fwd+bwd", "fwd+bwd-frozen"])
def test_liger_flce_per_token_backward_matches_the_oracle(pass_):
    """Liger's FLCE with reduction="none": the per-token upstream gradient reaches dhidden and
    dweight (Liger recomputes the chunks in its backward), under the Triton interpreter."""
    _check("liger_flce", "logprobs", pass_)


def test_bench_oracle_equals_the_transcription():
    from fgrpo_kernels.benchmarks import oracle as bench_oracle

    for workload in ("logprobs", "grpo", "fgrpo"):
        w = Workload.make(toy(workload=workload))
        got = bench_oracle.float64(w, workload, "fwd+bwd")
        out, dh, dw = oracle(w, workload)
        torch.testing.assert_close(got["out"], out.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["dhidden"], dh, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["dweight"], dw, rtol=1e-12, atol=1e-12)
    got = bench_oracle.float64(Workload.make(toy("fwd+bwd-frozen")), "logprobs", "fwd+bwd-frozen")
    assert set(got) == {"out", "dhidden"}


def test_bench_oracle_tolerates_bf16_and_catches_a_one_percent_error():
    """The check a bf16 row gets: the bf16 TRL pipeline passes, the same pipeline 1 % off fails
    on its output, 5 % off on its gradients too, and a non-finite output fails."""
    pytest.importorskip("trl")
    from fgrpo_kernels.benchmarks import oracle as bench_oracle

    case = Case("eager", "logprobs", "fwd+bwd", 4 * 64, 4099, 64, "bfloat16", "cpu", 4, Policy())
    w = Workload.make(case)
    step = PEERS["eager"].step("logprobs", "cpu")
    ok, errors, note = bench_oracle.check(step, w, "logprobs", "fwd+bwd", "bfloat16")
    assert ok and 1e-4 < errors["out"] < 1e-2 and set(errors) == {"out", "dhidden", "dweight"}
    assert w.hidden.grad is None and w.weight.grad is None
    ok, errors, note = bench_oracle.check(
        lambda w: step(w) * 1.01, w, "logprobs", "fwd+bwd", "bfloat16"
    )
    assert not ok and "out 0.01" in note and "dhidden" not in note  # 1 %: the output only
    ok, errors, note = bench_oracle.check(
        lambda w: step(w) * 1.05, w, "logprobs", "fwd+bwd", "bfloat16"
    )
    assert not ok and "out 0.05" in note and "dhidden 0.05" in note and "dweight" in note
    ok, _, note = bench_oracle.check(
        lambda w: step(w) * float("nan"), w, "logprobs", "fwd", "bfloat16"
    )
    assert not ok and "out inf" in note


def test_eager_peer_is_the_bf16_trl_pipeline_not_the_oracle():
    """In bf16 the eager peer's log-probs are TRL's selective_log_softmax of the bf16 logits
    h @ W.T (to 1e-6), and differ from the fp32 reference by more than 1e-3 at V ≥ 4096."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    case = Case("eager", "logprobs", "fwd", 4 * 32, 4099, 64, "bfloat16", "cpu", 4, Policy())
    w = Workload.make(case)
    out = run_step(PEERS["eager"].step("logprobs", "cpu"), w, "fwd")
    want = trl_utils.selective_log_softmax(w.hidden @ w.weight.T, w.ids).float()
    assert out.dtype == torch.float32 and out.shape == (4, 32)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    fp32 = reference.logprobs(w.hidden.float(), w.weight.float(), w.ids)
    assert (out - fp32).abs().max() > 1e-3
    # and its GRPO loss is the plain-torch loss on those log-probs
    loss = run_step(PEERS["eager"].step("grpo", "cpu"), w, "fwd")
    plain = reference.grpo_loss(want, None, w.ref_logps, w.advantages, w.mask, "dapo", GRPO_BETA)
    torch.testing.assert_close(loss, plain, rtol=0, atol=1e-6)


def test_floor_k_per_peer():
    k = {name: peer.floor_k("grpo", "fwd+bwd", "cuda") for name, peer in PEERS.items()
         if peer.runs("grpo")}  # fmt: skip
    assert k == {"eager": 6, "compile": 6, "liger": 6, "liger (eager)": 6, "liger_triton": 6,
                 "ours": 6, "ours_two_pass": 8}  # fmt: skip
    lp = {name: peer.floor_k("logprobs", "fwd+bwd", "cuda") for name, peer in PEERS.items()
          if peer.runs("logprobs")}  # fmt: skip
    assert lp == {"eager": 6, "compile": 6, "liger_flce": 8, "cce": 8, "trl": 8, "verl": 8,
                  "verl_triton": 8, "ours": 8}  # fmt: skip
    assert PEERS["ours"].floor_k("logprobs", "fwd", "cuda") == 2
    assert PEERS["ours_two_pass"].floor_k("grpo", "fwd+bwd-frozen", "cuda") == 6
    assert PEERS["eager"].floor_k("grpo", "fwd+bwd-frozen", "cuda") == 4


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


def test_missing_verl_names_its_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)
    monkeypatch.setitem(sys.modules, "verl.utils.experimental.torch_functional", None)
    result = measure.measure(toy(impl="verl"), "none")
    assert result["status"] == "unavailable" and "pip install verl==0.9.1" in result["note"]


@pytest.mark.parametrize(
    "peer,module,line",
    [("trl", "trl.kernels", "fgrpo-kernels[bench]"), ("eager", "trl.trainer.utils", "[bench]"),
     ("verl_triton", "verl.utils.kernel.linear_cross_entropy", "pip install verl==0.9.1"),
     ("liger_flce", "liger_kernel.ops.fused_linear_cross_entropy", "fgrpo-kernels[bench]")],
)  # fmt: skip
def test_every_missing_peer_names_its_install_line(monkeypatch, peer, module, line):
    for name in [module, *(module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1))]:
        monkeypatch.setitem(sys.modules, name, None)
    # a CUDA case: its import is tried (and fails) before any tensor is made
    case = dataclasses.replace(toy(impl=peer), device="cuda")
    result = measure.measure_here(case)
    assert result["status"] == "unavailable" and line in result["note"], result
    assert f"{PEERS[peer].package} is not installed" in result["note"]


def test_bench_extra_installs_trl():
    """So that `trl` (and the eager TRL pipeline) are never unavailable after pip install -e
    ".[bench]"."""
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    bench = project["project"]["optional-dependencies"]["bench"]
    assert any(dep.startswith("trl") for dep in bench)
    assert any(dep.startswith("liger-kernel") for dep in bench)


def test_peer_list_has_the_users_peers_and_no_timed_reference():
    assert {"liger_flce", "verl_triton", "ours_two_pass", "liger", "liger (eager)"} <= set(PEERS)
    import fgrpo_kernels.core.reference as ref

    for name, peer in PEERS.items():  # the oracle is never a timed peer
        for build in [peer.logprobs, *peer.losses.values()]:
            assert build is not ref.logprobs, name


def test_gpu_quick_preset_is_what_the_issue_asks():
    cases = PRESETS["gpu-quick"].cases()
    assert {c.workload for c in cases} == {"gemm", "logprobs", "grpo"}
    assert {c.pass_ for c in cases if c.workload != "gemm"} == {"fwd+bwd"}
    assert {c.tokens for c in cases} == {8192, 32768, 65536}
    assert {(c.dtype, c.hidden, c.vocab, c.device) for c in cases} == {
        ("bfloat16", 4096, 151936, "cuda")
    }
    assert {"liger_flce", "verl_triton", "ours_two_pass", "liger", "eager", "compile"} <= {
        c.impl for c in cases
    }
    assert PRESETS["gpu-quick"].budget_s == 240


def test_quick_preset_lists_every_peer_and_ours_to_65536():
    cases = PRESETS["cpu-quick"].cases()
    assert {c.impl for c in cases} == {
        "gemm", "eager", "compile", "liger", "cce", "trl", "verl", "ours", "ours_two_pass"
    }  # fmt: skip
    assert max(c.tokens for c in cases if c.impl == "ours") == 65536
    assert {c.workload for c in cases if c.impl == "ours"} == {
        "logprobs", "grpo", *VARIANT_WORKLOADS
    }  # fmt: skip
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


@pytest.mark.parametrize("workload", VARIANT_WORKLOADS)
def test_each_policy_variant_row_passes_the_oracle(monkeypatch, workload):
    """Our row of every policy variant equals the variant's float64 reference on the bench's
    tensors (old = the reference log-probs), and GRPO's step in its place fails the check."""
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    case = Case("ours", workload, "fwd+bwd", 96, 97, 16, "float32", "cpu", generations=4)
    w = Workload.make(case)
    ok, errors, note = bench_oracle.check(PEERS["ours"].step(workload, "cpu"), w, workload,
                                    "fwd+bwd", "float32")  # fmt: skip
    assert ok, note
    assert set(errors) == ({"out"} if workload in bench_oracle.VALUES_ONLY else
                           {"out", "dhidden", "dweight"})  # fmt: skip
    wrong, _, _ = bench_oracle.check(PEERS["ours"].step("grpo", "cpu"), w, workload, "fwd+bwd",
                               "float32")  # fmt: skip
    assert not wrong
    assert PEERS["ours"].floor_k(workload, "fwd+bwd", "cpu") == 8  # two-pass: recomputes


def test_variant_ratios_divide_by_the_grpo_row_of_the_same_size():
    base = {"impl": "ours", "status": "ok", "pass": "fwd+bwd", "tokens": 4096, "batch": 8,
            "vocab": 32768, "hidden": 128, "dtype": "float32"}  # fmt: skip
    rows = [
        {**base, "workload": "grpo", "time_ms": 100.0, "peak_mem_mib": 40.0},
        {**base, "workload": "policy:gmpo", "time_ms": 110.0, "peak_mem_mib": 20.0},
        {**base, "workload": "policy:m2po", "tokens": 1024, "time_ms": 5.0, "peak_mem_mib": 1.0},
    ]
    (line,) = report.variant_ratios(rows)  # m2po has no GRPO row of its size
    assert line.startswith("`policy:gmpo` / `grpo` (fwd+bwd, N=4096")
    assert "time 1.1" in line and "memory 0.5" in line


def test_the_oracle_reads_an_on_policy_value_against_the_advantages():
    """On-policy a sequence-ratio loss is −mean(a) = 0 on zero-mean advantages: rounding alone
    is then no relative error, read against mean |a| (the floor); elsewhere ‖want‖ stays."""
    got, want = torch.tensor(3e-9), torch.tensor(1e-17, dtype=torch.float64)
    assert bench_oracle.rel_err(got, want) > 1e6
    assert bench_oracle.rel_err(got, want, floor=0.8) == pytest.approx(3e-9 / 0.8, rel=1e-6)
    assert (
        bench_oracle.rel_err(torch.tensor(2.0), torch.tensor(1.0, dtype=torch.float64), 0.5) == 1.0
    )
