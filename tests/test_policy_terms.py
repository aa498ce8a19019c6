"""The GRPO policy terms are one table (`grpo_math.POLICY_TERMS`): every objective has one
entry with its own Triton branch id, and the reference, the fused CPU path and the metrics all
read the entry (swap an entry's formula and every one of them follows)."""

import dataclasses

import pytest
import torch

from fgrpo_kernels import FusedLinearGRPOLoss, reference
from fgrpo_kernels.core import grpo_math
from fgrpo_kernels.core.options import Objective


def test_every_objective_has_one_entry_and_its_own_triton_branch():
    assert set(grpo_math.POLICY_TERMS) == set(Objective)
    ids = [t.triton_id for t in grpo_math.POLICY_TERMS.values()]
    assert sorted(ids) == list(range(len(Objective)))


def test_swapping_an_entry_reaches_the_reference_and_the_fused_path(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3), generator=gen)
    mask, adv = torch.ones(2, 3), torch.tensor([1.0, -0.5], dtype=torch.float64)
    old = -2.5 + 0.2 * torch.randn(2, 3, generator=gen, dtype=torch.float64)

    def losses():
        fused, metrics = FusedLinearGRPOLoss("sapo", beta=0.0)(h, w, ids, mask, adv,
                                                              old_per_token_logps=old)  # fmt: skip
        lp = torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None])[..., 0]
        ref = reference.grpo_loss(lp, old, None, adv, mask, "sapo", 0.0)
        return float(fused), float(ref), metrics

    before = losses()
    doubled = dataclasses.replace(
        grpo_math.POLICY_TERMS[Objective.SAPO],
        term=lambda lp, w, a, opts: 2.0 * grpo_math._sapo(lp, w, a, opts),
        clips=grpo_math._clipped_tokens,
        clip_metrics="trl",
    )
    monkeypatch.setitem(grpo_math.POLICY_TERMS, Objective.SAPO, doubled)
    after = losses()
    assert before[0] == pytest.approx(before[1], rel=1e-6)
    assert after[0] == pytest.approx(2.0 * before[0], rel=1e-6)
    assert after[1] == pytest.approx(2.0 * before[1], rel=1e-6)
    assert "clip_ratio/low_mean" in after[2] and "clip_ratio/low_mean" not in before[2]
