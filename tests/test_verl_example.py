"""examples/verl/smoke_update_policy.py, the verl example's CPU smoke run: verl 0.9.1's FSDP
engine, built from verl's own trainer config with our three config lines, computes the actor's
log-probs and runs one actor update through our fused head (backend "fgrpo"), rmpad and padded,
tied and untied (DTensor) lm_head; the results are checked here, apart from the script's own
verdict. The negative control runs the same script without our lines and must fail.

Needs verl (the venv of bench/verl_env.sh; `FGRPO_REQUIRE_VERL=1` makes a missing verl a failure).
Each run is a subprocess: the script points verl at the CPU and starts a gloo process group.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .verl_guard import need_verl

need_verl()

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "verl" / "smoke_update_policy.py"
TOLERANCE = 1e-5


def _smoke(tmp_path, *args):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = json.loads(out.read_text()) if out.exists() else None
    return done, results


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return _smoke(tmp_path_factory.mktemp("verl_smoke"))


def test_smoke_run_passes(smoke):
    done, results = smoke
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    cases = {(r["tied"], r["layout"]) for r in results}
    assert cases == {(True, "rmpad"), (True, "padded"), (False, "rmpad")}
    assert all(r["failures"] == [] for r in results)
    assert "actor/pg_loss=" in done.stdout


@pytest.mark.parametrize("case", range(3))
def test_loss_and_gradients_flow_through_our_head(smoke, case):
    _, results = smoke
    r = results[case]
    assert r["backend"] == "fgrpo" and r["loss_mode"] == "vanilla"
    assert math.isfinite(r["metrics"]["actor/pg_loss"])
    assert math.isfinite(r["metrics"]["actor/entropy_loss"])
    assert r["metrics"]["grad_norm"] > 0
    # one call of our head per micro-batch forward, in compute_log_prob and in the update
    assert r["micro_batches"] >= 2
    assert r["head_calls_compute_log_prob"] == r["micro_batches"]
    assert r["head_calls_update"] == r["micro_batches"]
    # every parameter: a finite nonzero gradient, changed by the optimizer step
    names = r["params"]
    assert any("embed_tokens" in n for n in names) and any("layers.1." in n for n in names)
    assert ("lm_head.weight" in names) == (not r["tied"])
    assert r["grads_missing"] == r["grads_nonfinite"] == r["grads_zero"] == r["unchanged"] == []
    # verl's torch backend where it runs (tied lm_head), stock verl (no fused kernels) always
    want = {"torch", "stock"} if r["tied"] else {"stock"}
    assert set(r["references"]) == want
    for ref in r["references"].values():
        assert ref["head_calls"] == 0
        assert ref["logp_rel_err"] <= TOLERANCE
        assert ref["entropy_rel_err"] <= TOLERANCE
        assert ref["entropy_loss_rel_err"] <= TOLERANCE
        assert set(ref["grad_rel_err"]) == set(names)
        assert max(ref["grad_rel_err"].values()) <= TOLERANCE


def test_without_our_lines_the_smoke_run_fails(tmp_path):
    done, results = _smoke(tmp_path, "--backend", "stock", "--layout", "padded")
    assert done.returncode == 1, done.stderr[-4000:]
    (r,) = results
    assert r["head_calls_compute_log_prob"] == r["head_calls_update"] == 0
    assert any("our head was called 0 times" in f for f in r["failures"])


# stands in for `python3` on PATH: composes verl's trainer config from the launch script's
# command line as `python3 -m verl.trainer.main_ppo` would (Hydra, ppo_trainer.yaml), no run
COMPOSE = """
import json, os, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
import verl
assert sys.argv[1:3] == ["-m", "verl.trainer.main_ppo"], sys.argv[:3]
config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
with initialize_config_dir(config_dir=config_dir, version_base=None):
    cfg = compose("ppo_trainer", overrides=sys.argv[3:])
if os.environ.get("COMPOSE_PART") == "fgrpo":
    print(json.dumps({"loss_mode": cfg.actor_rollout_ref.actor.policy_loss.loss_mode,
                      "adv_estimator": cfg.algorithm.adv_estimator}))
else:
    print(json.dumps(OmegaConf.to_container(cfg.actor_rollout_ref.model, resolve=False)))
"""


def _compose_launch(tmp_path, **env_extra):
    (tmp_path / "compose.py").write_text(COMPOSE)
    shim = tmp_path / "python3"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "compose.py"}" "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", **env_extra}
    env.pop("STOCK", None)
    script = SCRIPT.parent / "run_grpo_fgrpo.sh"
    return subprocess.run(
        ["bash", str(script), "trainer.total_epochs=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_launch_script_with_loss_is_an_fgrpo_run(tmp_path):
    """LOSS=fgrpo_js: verl's composed config picks our policy loss and advantage estimator."""
    done = _compose_launch(tmp_path, LOSS="fgrpo_js", COMPOSE_PART="fgrpo")
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = json.loads(done.stdout.strip().splitlines()[-1])
    assert chosen == {"loss_mode": "fgrpo_js", "adv_estimator": "fgrpo"}


def test_smoke_run_with_an_fgrpo_loss_passes(tmp_path):
    done, results = _smoke(tmp_path, "--layout", "rmpad", "--loss-mode", "fgrpo_pearson")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert results and all(r["loss_mode"] == "fgrpo_pearson" for r in results)
    for r in results:
        assert math.isfinite(r["metrics"]["actor/pg_loss"]) and not r["failures"]
        assert r["head_calls_update"] > 0


def test_launch_script_composes_with_verls_config(tmp_path):
    """Every override of examples/verl/run_grpo_fgrpo.sh is a key of verl 0.9.1's trainer
    config, and the result turns our backend on (the script itself needs GPUs, Ray, vLLM)."""
    done = _compose_launch(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    model = json.loads(done.stdout.strip().splitlines()[-1])
    assert model["external_lib"] == "fgrpo_kernels.integrations.verl_enable"
    assert model["use_fused_kernels"] is True
    assert model["fused_kernel_options"]["impl_backend"] == "fgrpo"
    assert model["use_remove_padding"] is True
