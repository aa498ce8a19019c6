"""fgrpo_kernels.testing: the strategies draw what they promise; the checker catches errors."""

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given

from fgrpo_kernels import reference as R
from fgrpo_kernels.testing import assert_loss_close, batches, linear_batches, rel_error


@given(b=batches())
def test_batches_are_well_formed(b):
    B, T = b.logps.shape
    assert B % b.num_generations == 0 and B >= 2
    for t in (b.ref_logps, b.old_logps, b.mask):
        assert t.shape == (B, T)
    assert b.mask.dtype == torch.bool and b.mask.sum(-1).max() == T
    assert b.advantages.shape == b.rewards.shape == b.chosen.shape == (B,)
    assert b.chosen.any() and (~b.chosen).any()
    assert (b.logps <= 0).all() and torch.isfinite(b.logps.float()).all()


@given(lb=linear_batches())
def test_linear_batches_are_well_formed(lb):
    B, T = lb.batch.logps.shape
    V, H = lb.weight.shape
    assert lb.hidden.shape == (B, T, H) and lb.completion_ids.shape == (B, T)
    assert lb.completion_ids.max() < V and (lb.bias is None or lb.bias.shape == (V,))


@given(b=batches(dtypes=(torch.float32,)))
def test_reference_passes_its_own_check(b):
    assert_loss_close(
        R.fgrpo_loss,
        R.fgrpo_loss,
        b.kwargs("logps", "ref_logps", "advantages", "mask"),
        wrt=("logps",),
    )


def test_checker_reports_a_wrong_gradient_with_a_label():
    torch.manual_seed(0)
    inputs = dict(
        logps=-torch.rand(4, 6) * 3,
        ref_logps=-torch.rand(4, 6) * 3,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        mask=torch.ones(4, 6),
    )

    def wrong(logps, ref_logps, advantages, mask):
        return R.fgrpo_loss(logps * 1.001, ref_logps, advantages, mask)

    with pytest.raises(AssertionError, match=r"my loss differs .*d/dlogps: rel err"):
        assert_loss_close(wrong, R.fgrpo_loss, inputs, label="my loss", floor=1e-6)
    assert_loss_close(R.fgrpo_loss, R.fgrpo_loss, inputs, label="my loss", floor=1e-6)


def test_rel_error():
    assert rel_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0.0
    assert rel_error(torch.tensor([3.0]), torch.tensor([2.0])) == pytest.approx(0.5)


def test_readme_example_runs():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"<!-- testing-example -->\n```python\n(.*?)```", readme, re.S)
    assert block, "README lacks the fgrpo_kernels.testing example"
    namespace = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    namespace["test_my_fgrpo_loss"]()
