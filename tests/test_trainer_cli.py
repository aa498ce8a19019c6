"""`fgrpo train` as a user meets it: one-line errors found before the model is loaded, every
default in --help, the run folder's files, --overwrite, LoRA."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from fgrpo_kernels.cli import main  # noqa: E402
from fgrpo_kernels.trainer import loading  # noqa: E402
from fgrpo_kernels.trainer.tiny import tiny_model, tiny_tokenizer  # noqa: E402

from .trainer_common import TRAIN, cpu_path  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("cpu_path")


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    """Checkpoint folders the trainer must refuse: Gemma-2's soft-capped head (config only:
    the check must not need weights), tokenizers whose eos is missing or outside the vocab."""
    from transformers import Gemma2Config

    root = tmp_path_factory.mktemp("models")
    Gemma2Config(
        vocab_size=19, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    ).save_pretrained(root / "gemma2")  # fmt: skip
    for name in ("eos_is_v", "no_eos"):
        tiny_model(0).config.save_pretrained(root / name)  # config only: weights never needed
        tok = tiny_tokenizer()
        tok.eos_token = tok.pad_token = None
        if name == "eos_is_v":
            tok.add_special_tokens({"eos_token": "<end>"})  # id 19 == vocab_size
        tok.save_pretrained(root / name)
    (root / "file").write_text("not a folder")
    (root / "nonempty").mkdir()
    (root / "nonempty" / "notes.txt").write_text("mine")
    (root / "data.jsonl").write_text('{"question": "1+1=", "answer": "two"}\n')
    return root


def cases(root):
    fresh = str(root / "fresh")
    return [
        (["--out", fresh, "--model", "/nonexistent"], "--model: no such folder: '/nonexistent'"),
        (["--out", fresh, "--model", str(root / "file")], "--model: .* is a file"),
        (["--out", fresh, "--model", str(root / "gemma2")], "--model: final_logit_softcapping=30"),
        (
            ["--out", fresh, "--model", str(root / "eos_is_v")],
            "tokenizer: eos_token '<end>' has id 19",
        ),
        (["--out", fresh, "--model", str(root / "no_eos")], "tokenizer: has no eos_token"),
        (["--out", str(root / "file")], "--out: .* is a file"),
        (["--out", str(root / "nonempty")], "--out: .* is not empty; pass --resume .* --overwrite"),
        (["--out", fresh, "--resume"], "--resume: no checkpoint in"),
        (["--out", fresh, "--num-generations", "1"], "--num-generations: expected an int >= 2"),
        (["--out", fresh, "--rollouts-per-step", "12"], "--rollouts-per-step: expected a multiple"),
        (["--out", fresh, "--prompts-per-step", "4", "--rollouts-per-step", "16"], "not both"),
        (["--out", fresh, "--lr", "0"], "--lr: expected a finite number > 0"),
        (["--out", fresh, "--prompts", "missing.jsonl"], "--prompts: no such file"),
        (["--out", fresh, "--prompts", str(root / "data.jsonl")], "--prompts: row 1 .*'question'"),
        (
            [
                "--out",
                fresh,
                "--prompts",
                str(root / "data.jsonl"),
                "--prompt-column",
                "question",
                "--reward",
                "numeric",
            ],
            "--reward: numeric needs a number in 'answer'; row 1 has 'two'",
        ),  # fmt: skip
        (["--out", fresh, "--reward", "nowhere:f"], "--reward: no module named 'nowhere'"),
        (["--out", fresh, "--reward", "pattern", "--reward-weights", "1", "2"], "--reward-weights"),
        (["--out", fresh, "--eval-prompts", "x.jsonl"], "--eval-prompts: needs --prompts"),
        (["--out", fresh, "--loss", "ppo"], "argument --loss: invalid choice"),
        (["--out", fresh, "--steps", "x"], "argument --steps: invalid int value"),
        (["--steps", "3"], "the following arguments are required: --out"),
        (["--out", fresh, "--task-steps", "1x"], "--task-steps: expected digits"),
        (["--out", fresh, "--threads", "0"], "--threads: expected an int >= 1"),
        (["--out", fresh, "--device", "tpu"], "--device: expected auto, cpu, cuda or cuda:N"),
        (["--out", fresh, "--fsdp"], "--fsdp: FSDP2 shards the model over the ranks of a torchrun"),
    ]


def test_each_user_error_is_one_line_before_loading(bad_models, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_base", never)
    for args, message in cases(bad_models):
        try:
            rc = main([*TRAIN, *args])
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("fgrpo train: error: "), (args, err)
        assert re.search(message, err), (args, err)
    assert not (bad_models / "fresh").exists()  # nothing written on the way


def test_an_error_is_one_line_from_the_shell(tmp_path):
    env = dict(os.environ, FGRPO_BACKEND="cpu")
    args = [sys.executable, "-m", "fgrpo_kernels.cli", "train", "--out", str(tmp_path / "r")]
    done = subprocess.run(
        [*args, "--num-generations", "1"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "fgrpo train: error: --num-generations: expected an int >= 2 (advantages compare the "
        "completions of one prompt; a group of one learns nothing); got 1"
    ]


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    from fgrpo_kernels.cli import Parser
    from fgrpo_kernels.trainer.cli import add_arguments

    parser = Parser(prog="fgrpo train")
    add_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.nargs != 0:  # flags (store_true) have no default
            assert "(default: " in action.help, action.option_strings
    assert "(default: 8)" in text and "(default: 0.003)" in text and "(default: pearson)" in text
    assert "fgrpo/fhal 0.1, grpo 0.04, gift 1.0" in text


def test_outputs_and_the_final_checkpoint_trains_again(tmp_path):
    out = tmp_path / "run"
    assert main([*TRAIN, "--out", str(out), "--steps", "3", "--loss", "grpo"]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(
        {"reward_mean", "loss", "kl", "entropy", "clip_ratio/region_mean"} <= r.keys()
        for r in records
    )
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["rollouts"] == 128 for r in records)
    assert (out / "training.png").stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["interrupted_by"] is None
    assert summary["loss"] == "grpo dapo" and 0 <= summary["chance_reward"] <= 1
    assert json.loads((out / "run.json").read_text())["options"]["loss"] == "grpo"
    again = tmp_path / "again"
    args = [*TRAIN, "--out", str(again), "--steps", "1", "--model", str(out / "final")]
    assert main(args) == 0
    assert len((again / "metrics.jsonl").read_text().splitlines()) == 1


def test_overwrite_replaces_the_run_and_only_the_run(tmp_path):
    out = tmp_path / "run"
    assert main([*TRAIN, "--out", str(out), "--steps", "2", "--save-every", "1"]) == 0
    (out / "notes.txt").write_text("mine")
    assert main([*TRAIN, "--out", str(out), "--steps", "1", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        ".lock", "final", "metrics.jsonl", "notes.txt", "run.json", "summary.json",
        "train_config.json", "training.png",
    ]  # fmt: skip
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_lora_trains_an_adapter_against_the_adapter_free_reference(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "run"
    args = [*TRAIN, "--out", str(out), "--steps", "3", "--lora-r", "4", "--lr", "1e-2"]
    assert main(args) == 0
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert not (out / "final" / "model.safetensors").exists()  # the adapter only
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6) and records[-1]["kl"] > 0


def test_compare_plot_of_two_runs(tmp_path):
    from fgrpo_kernels.trainer.plots import main as plots_main

    for g in ("2", "8"):
        args = [*TRAIN, "--out", str(tmp_path / f"g{g}"), "--steps", "2", "--num-generations", g]
        assert main([*args, "--rollouts-per-step", "16"]) == 0
    records = [json.loads(x) for x in (tmp_path / "g2" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["rollouts"] == 16
    png = tmp_path / "compare.png"
    assert plots_main([str(tmp_path / "g2"), str(tmp_path / "g8"), "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000
