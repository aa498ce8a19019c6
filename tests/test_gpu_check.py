"""bench/gpu_check.py on the CPU (interpreter, toy sizes): the whole run end to end, and its
control flow — a failing case is a row and the rest runs, rows reach the disk one by one, the
deadline cuts a stuck case and skips the rest, the out_dtype probe failing fails the run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402
import gpu_correctness  # noqa: E402
import gpu_timing  # noqa: E402


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "triton")


def test_dry_run_end_to_end(tmp_path):
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--iters", "2",
           "--out", str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    corr = rows(tmp_path / "correctness.csv")
    tim = rows(tmp_path / "timing.csv")
    assert tuple(corr[0]) == gpu_check.CORRECTNESS_COLUMNS
    assert tuple(tim[0]) == gpu_check.TIMING_COLUMNS
    names = {r["case"] for r in corr}
    assert names == set(gpu_correctness.cases(tiny=True)) | {"out_dtype_mm_probe"}
    for r in corr[1:]:
        assert r["status"] == "ok" and r["ok"] == "1", r
        assert float(r["rel_err"]) <= float(r["tol"]), r
    # every candidate and both loop orders are among the cases
    assert sum(n.startswith("candidate_") for n in names) == 4
    assert {"tiles_rows_outer", "tiles_cols_outer"} <= names
    plan = gpu_timing.timing_plan(tiny=True)
    assert [(r["impl"], r["pass"], int(r["N"])) for r in tim] == plan
    for r in tim:
        if r["impl"] in ("liger", "liger_grpo", "cut_cross_entropy"):
            assert r["status"] in ("skipped (needs CUDA)", "not installed"), r
            continue
        assert r["status"] == "ok", r
        assert float(r["total_ms"]) > 0
        if r["impl"] == "gemm_ceiling":
            assert float(r["tflops"]) > 0
        else:
            assert float(r["fwd_ms"]) > 0 and float(r["ratio_to_floor"]) > 0
            if r["pass"] != "fwd no_grad":
                assert float(r["bwd_ms"]) > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## Correctness" in md and "## Timing" in md
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["mode"] == "tiny" and meta["cublas_out_dtype_mm"] is False


def test_failing_case_is_a_row_and_the_rest_runs(tmp_path, monkeypatch, triton_backend):
    real = gpu_correctness.check

    def check(p, dev):
        if p.N == 1:
            raise RuntimeError("injected: no kernel image is available")
        return real(p, dev)

    monkeypatch.setattr(gpu_correctness, "check", check)
    rc = gpu_check.main(["--tiny", "--out", str(tmp_path), "--iters", "1",
                         "--only", "single_token,all_ignored"])  # fmt: skip
    assert rc == 1
    by_case = {}
    for r in rows(tmp_path / "correctness.csv"):
        by_case.setdefault(r["case"], []).append(r)
    (failed,) = by_case["single_token"]
    assert failed["status"] == "error: RuntimeError: injected: no kernel image is available"
    assert by_case["all_ignored"] and all(r["ok"] == "1" for r in by_case["all_ignored"])
    assert "single_token" in (tmp_path / "gpu_check.md").read_text()


def test_deadline_cuts_a_stuck_case_and_skips_the_rest(tmp_path, monkeypatch, triton_backend):
    def stuck(p, dev):
        time.sleep(30)

    monkeypatch.setattr(gpu_correctness, "check", stuck)
    t0 = time.monotonic()
    rc = gpu_check.main(["--tiny", "--out", str(tmp_path), "--budget-s", "1.5",
                         "--only", "fp32,fp16,ours"])  # fmt: skip
    assert time.monotonic() - t0 < 20 and rc == 1
    corr = {r["case"]: r["status"] for r in rows(tmp_path / "correctness.csv")}
    assert corr["fp32"] == "timeout (budget 2 s)"
    assert corr["fp16"] == gpu_check.SKIPPED
    assert {r["status"] for r in rows(tmp_path / "timing.csv")} == {gpu_check.SKIPPED}
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["wall_s"] >= 1.5


def test_rows_reach_the_disk_before_the_run_ends(tmp_path, monkeypatch, triton_backend):
    """A kill in the middle (here a KeyboardInterrupt in the timing phase) leaves every
    correctness row already on disk."""

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_timing, "time_row", killed)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--tiny", "--out", str(tmp_path), "--only", "all_ignored,ours"])
    corr = rows(tmp_path / "correctness.csv")
    assert {r["case"] for r in corr} == {"out_dtype_mm_probe", "all_ignored"}
    assert len(corr) > 3 and (tmp_path / "meta.json").exists()


def test_missing_out_dtype_mm_fails_the_run_loudly(tmp_path, capsys):
    """On a GPU whose torch lacks the out_dtype overloads the check fails."""
    table = gpu_check.Table(tmp_path / "c.csv", gpu_check.CORRECTNESS_COLUMNS)
    gpu_check.probe(table, torch.device("cuda"), available=False)
    assert "FAILED: torch.mm/addmm have no out_dtype" in capsys.readouterr().err
    (row,) = rows(tmp_path / "c.csv")
    assert row["ok"] == "0" and gpu_check.failures(table.rows) == table.rows
    gpu_check.probe(table, torch.device("cpu"), available=False)  # the dry run: no kernel
    assert len(gpu_check.failures(table.rows)) == 1


def test_logp_tolerance_rests_on_the_measured_accumulation_floor():
    """The per-token tolerance at H 16384 comes from `ACCUMULATION_FLOOR`, which the CPU
    measurement reproduces at a small size: the truncating (tensor-core) model well above the
    IEEE round-to-nearest floor; the H200's 1.65e-4 (2026-12-04) passes, 1e-4 would not."""
    import accumulation_floor

    p = gpu_correctness.Problem(64, 16384, 151936, bias=True)
    tol = gpu_correctness.logp_abs_tolerance(p)
    assert tol == pytest.approx(1.5 * gpu_correctness.ACCUMULATION_FLOOR[16384])
    assert 1.65e-4 <= tol < 1e-3
    assert gpu_correctness.logp_abs_tolerance(gpu_correctness.Problem(64, 520, 5003)) == 1e-4
    got = accumulation_floor.measure(520, N=32, V=1024, seeds=1)
    rz, rne = got["rz_k16"][0], got["rne_k64"][0]
    assert 0.3 < rz / gpu_correctness.ACCUMULATION_FLOOR[520] < 3.0, got
    assert rne < rz / 2, got


def test_loss_tolerance_follows_the_logp_tolerance():
    """A KL-dominated GRPO loss moves by the log-probs' mean absolute error: a uniform shift of
    5e-5 (under the per-token tolerance) passes, as the H200's 6.3e-5 does; 5e-4 fails."""
    from fgrpo_kernels import reference

    p = gpu_correctness.Problem(24, 4096, 151936, tau=0.7)
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    lp = (-14.0 + torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    ent = (10.0 + torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    ref = -4.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = ref + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, mask = torch.linspace(-1, 1, B, dtype=torch.float64), torch.ones(B, T, dtype=torch.bool)
    kw = {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01}
    loss = reference.grpo_loss(lp, old, ref, adv, mask, entropy=ent, **kw)
    loss.backward()
    kappa = float((lp.grad.abs().sum() + ent.grad.abs().sum()) / loss.detach().abs())
    assert 0.9 < kappa < 1.1
    tol = gpu_correctness.loss_tolerance(p, kappa)
    for shift, ok in ((5e-5, True), (5e-4, False)):
        moved = reference.grpo_loss(
            lp.detach() - shift, old, ref, adv, mask, entropy=ent.detach(), **kw
        )
        err = float((moved - loss.detach()).abs() / loss.detach().abs())
        assert err > 1e-5 and (err <= tol) == ok, (shift, err, tol)


def test_single_pass_bf16_rows_carry_the_loss_tolerance(triton_backend):
    p, fn = gpu_correctness.cases(tiny=True)["single_pass_bf16"]
    rows = {r["quantity"]: r for r in fn(p, torch.device("cpu"))}
    assert rows["single_pass_ran"]["ok"] == 1
    loss = rows["loss"]
    assert loss["ok"] == 1 and loss["tol"] > 1e-5 and loss["rel_err"] <= loss["tol"]


def test_floor_k_counts_the_logits_gemms_each_impl_runs():
    """eager and torch.compile keep the logits (6·N·H·V with both gradients), the two-pass loss
    recomputes them (8), the log-prob primitives recompute (8), a forward alone is 2."""
    assert gpu_timing.floor_k("eager", "fwd+bwd") == 6
    assert gpu_timing.floor_k("torch_compile", "fwd+bwd") == 6
    assert gpu_timing.floor_k("ours", "fwd+bwd") == 8
    assert gpu_timing.floor_k("ours_grpo_single", "loss fwd+bwd") == 6
    assert gpu_timing.floor_k("ours_grpo_two_pass", "loss fwd+bwd") == 8
    assert gpu_timing.floor_k("ours", "fwd no_grad") == 2
