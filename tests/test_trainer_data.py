"""The trainer's data and rewards: JSONL/CSV/datasets folders, the held-out split, the epoch
sampler, the built-in rewards, TRL's reward signature, weights and per-function statistics;
a JSONL dataset with a custom reward function trains."""

import csv
import json
import math
import random

import pytest
import torch

pytest.importorskip("transformers")

from fgrpo_kernels.cli import main  # noqa: E402
from fgrpo_kernels.trainer import rewards as R  # noqa: E402
from fgrpo_kernels.trainer.data import PromptSampler, load_rows, split_rows  # noqa: E402
from fgrpo_kernels.trainer.scoring import fill_unscored  # noqa: E402

from .trainer_common import cpu_path  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("cpu_path")

ROWS = [
    {"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 2} for a in range(5) for b in (1, 2)
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_csv_and_datasets_folder_give_the_same_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["question", "answer", "level"])
        w.writeheader()
        w.writerows(
            {"question": r["prompt"], **{k: r[k] for k in ("answer", "level")}} for r in ROWS
        )
    rows, held = load_rows(jsonl)
    assert rows == ROWS and held is None
    rows, _ = load_rows(tmp_path / "d.csv", prompt_column="question")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in ROWS]
    assert rows[3]["answer"] == ROWS[3]["answer"]  # CSV values are strings
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    assert load_rows(folder)[0] == ROWS
    split = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS[:7]), test=datasets.Dataset.from_list(ROWS[7:])
    )
    split.save_to_disk(str(tmp_path / "split"))
    assert load_rows(tmp_path / "split") == (ROWS[:7], ROWS[7:])


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("missing.jsonl", None, "no such file"),
        ("d.txt", "x", "expected a .jsonl"),
        ("d.jsonl", '{"prompt": "1"}\n{"prompt": \n', "line 2 .* not valid JSON"),
        ("d.jsonl", '{"question": "1+1="}\n', "no 'prompt' column .*--prompt-column"),
        ("d.jsonl", '{"prompt": ""}\n', "non-empty prompt"),
        ("d.jsonl", "\n", "holds no rows"),
        ("d.json", "[1, 2]", "row 1 .* not an object"),
    ],
)
def test_bad_prompt_files_name_the_option(tmp_path, name, content, match):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=f"^prompts: .*{match}"):
        load_rows(tmp_path / name)


def test_split_rows_holds_out_a_seeded_fraction_or_count():
    train, held = split_rows(ROWS, 0.3, seed=1)
    assert len(held) == 3 and len(train) == 7
    assert sorted(map(str, train + held)) == sorted(map(str, ROWS))
    assert split_rows(ROWS, 0.3, seed=1) == (train, held)
    assert len(split_rows(ROWS, 4, seed=1)[1]) == 4
    for bad in (0, 1.5, 10, 0.01):
        with pytest.raises(ValueError, match="^eval_size"):
            split_rows(ROWS, bad, seed=1)


def test_sampler_draws_each_row_once_per_epoch_and_resumes():
    sampler = PromptSampler(ROWS, seed=3)
    first = sampler.draw(10)
    assert sorted(map(str, first)) == sorted(map(str, ROWS))
    ahead = sampler.draw(7)
    again = PromptSampler(ROWS, seed=3)
    again.load_state_dict({"drawn": 10})
    assert again.draw(7) == ahead
    assert PromptSampler(ROWS, seed=4).draw(10) != first


def test_builtin_rewards():
    assert R.exact_match()(completions=[" 7 ", "70", "7"], answer=["7", "7", 7]) == [1.0, 0.0, 1.0]
    got = R.numeric("sol")(
        completions=["it is 1,234", "-3.5", "none", "7"], sol=["#### 1234", "-3.50", "1", "x"]
    )
    assert got == [1.0, 1.0, 0.0, None]
    fmt = R.regex_format(r"<a>\d+</a>")
    assert fmt(completions=["<a>12</a>", " <a>1</a>\n", "<a>x</a>", "<a>1</a> and more"]) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert R.pattern(["2345?", "210?"], ["6", "9x"]) == [1.0, 0.5]
    assert R.parse_number("no digits") is None and R.parse_number(2.5) == 2.5
    with pytest.raises(ValueError, match=r"^reward: regex:\("):
        R.regex_format("(")


def test_reward_set_weights_none_and_statistics():
    def correct(prompts, completions, answer, **kwargs):
        return [None if a == "?" else float(c == a) for c, a in zip(completions, answer)]

    def brief(completions, log_metric, **kwargs):
        log_metric("brief/chars", sum(map(len, completions)) / len(completions))
        return [None if c == "" else float(len(c) <= 1) for c in completions]

    rewards = R.RewardSet([correct, brief], [1.0, 0.5])
    total, per_func, metrics = rewards(
        ["p"] * 4, ["3", "33", "", "1"], [[1], [1, 1], [], [2]],
        {"answer": ["3", "3", "?", "2"]}, R.RewardState(),
    )  # fmt: skip
    assert per_func[2].isnan().all() and total[2].isnan()  # scored by nobody
    torch.testing.assert_close(total[[0, 1, 3]], torch.tensor([1.5, 0.0, 0.5]))
    assert metrics["rewards/correct/mean"] == pytest.approx(1 / 3)
    assert metrics["rewards/brief/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/brief/std"] == pytest.approx(torch.tensor([1.0, 0, 1]).std().item())
    assert metrics["brief/chars"] == pytest.approx(1.0)
    assert R.RewardSet([correct, correct]).names == ["correct", "correct_2"]
    with pytest.raises(ValueError, match="^reward_weights"):
        R.RewardSet([correct, brief], [1.0])


def test_reward_signatures_trl_keywords_and_plain_positional():
    seen = {}

    def trl_style(prompts, completions, completion_ids, trainer_state, level, **kwargs):
        seen.update(ids=completion_ids, step=trainer_state.global_step, level=level)
        return [1.0] * len(completions)

    def plain(p, c):  # neither TRL's names nor **kwargs: called positionally
        return [float(x == "1") for x in c]

    rewards = R.RewardSet([trl_style, plain])
    rewards.check_columns({"level"})
    total, _, _ = rewards(
        ["a", "b"], ["1", "2"], [[5], [6]], {"level": [0, 1]}, R.RewardState(4, 9)
    )
    assert total.tolist() == [2.0, 1.0] and seen == {"ids": [[5], [6]], "step": 4, "level": [0, 1]}
    with pytest.raises(ValueError, match="^reward: trl_style cannot be called.*level"):
        R.RewardSet(trl_style).check_columns({"answer"})
    with pytest.raises(ValueError, match="^reward: exact_match needs the column 'answer'"):
        R.RewardSet(R.exact_match()).check_columns({"level"})

    def one(prompts, completions):
        return [1.0]

    with pytest.raises(R.RewardError, match="^reward: one returned 1 rewards; expected 3"):
        R.RewardSet(one)(["a"] * 3, ["1"] * 3, [[1]] * 3, {}, R.RewardState())
    bad = R.RewardSet(lambda prompts, completions: ["high"] * len(completions))
    with pytest.raises(R.RewardError, match="returned 'high'; expected floats or None"):
        bad(["a"], ["1"], [[1]], {}, R.RewardState())


def test_reward_functions_load_from_module_or_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def seven(completions, **kw):\n    return [1.0] * len(completions)\nX = 3\n"
    )
    (tmp_path / "broken.py").write_text("def oops(:\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert R.resolve("my_rewards:seven")(completions=["a"]) == [1.0]
    assert R.resolve(f"{tmp_path}/my_rewards.py:seven").__name__ == "seven"
    for spec, match in [
        ("nomodule:f", "no module named 'nomodule'"),
        ("my_rewards:nothing", "has no attribute 'nothing'"),
        ("my_rewards:X", "not callable"),
        ("broken:oops", "importing 'broken' failed: SyntaxError"),
        ("missing.py:f", "no such file"),
        ("exact", "expected a built-in"),
    ]:
        with pytest.raises(ValueError, match=f"^reward: .*{match}"):
            R.resolve(spec)


def test_unscored_completions_get_their_group_mean_and_no_advantage():
    rewards = torch.tensor([1.0, math.nan, 0.0, math.nan, math.nan, math.nan])
    filled, unscored = fill_unscored(rewards, 3)
    assert filled.tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert unscored.tolist() == [False, True, False, True, True, True]


def test_a_jsonl_dataset_with_a_custom_reward_trains(tmp_path):
    """`fgrpo train --prompts data.jsonl --reward my_reward.py:fn` learns the data's answers."""
    rng = random.Random(0)
    rows = []
    for _ in range(60):
        a, b = rng.randrange(5), rng.randrange(5)
        rows.append({"prompt": f"{a}+{b}=", "answer": "7" if a % 2 else "8", "source": "toy"})
    data = write_jsonl(tmp_path / "sums.jsonl", rows)
    (tmp_path / "my_reward.py").write_text(
        "def sum_right(prompts, completions, answer, source, **kwargs):\n"
        "    assert set(source) == {'toy'}\n"
        "    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]\n"
    )
    out = tmp_path / "run"
    args = [
        "train", "--out", str(out), "--prompts", str(data), "--reward",
        f"{tmp_path}/my_reward.py:sum_right", "--reward", r"regex:\d", "--reward-weights", "1",
        "0.2", "--steps", "40", "--prompts-per-step", "8", "--lr", "1e-2", "--eval-every", "20",
        "--eval-size", "12", "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    right = [r["rewards/sum_right/mean"] for r in records]
    assert sum(right[-8:]) / 8 > sum(right[:8]) / 8 + 0.15, right
    assert {"rewards/regex/mean", "eval/reward_mean", "eval/pass_rate"} <= records[-1].keys()
    assert "eval/pass_rate" in records[19] and "eval/pass_rate" not in records[20]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["eval"]["step"] == 40
    assert 0.0 <= summary["chance_reward"] < 0.5
