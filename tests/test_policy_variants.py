"""fgrpo_kernels.core.policy_variants against its sources in the main venv: GMPO against TRL's
own `GMPOTrainer._compute_loss` (imported, on a stub trainer), GSPO-token against TRL's GSPO
(`GRPOTrainer._compute_loss` at importance_sampling_level "sequence"), and the verl-derived
losses (verl 0.9.1, absent here) and M2PO (Infini-AI-Lab/M2PO af54a3e) on hand-computed cases.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fgrpo_kernels.core import policy_m2po as m2po
from fgrpo_kernels.core import policy_variants as pv
from fgrpo_kernels.core import policy_variants_verl as pvv
from fgrpo_kernels.core import policy_variants_verl_pg as pvp

from .policy_cases import base_batch, matrix


@st.composite
def batches(draw):
    logp, old, adv, mask = base_batch(draw)
    B, T = logp.shape
    entropy = torch.rand(B, T, generator=torch.Generator().manual_seed(B + 7 * T)) * 3
    return logp, old, matrix(draw, B, T), adv, mask, entropy


def grad_of(fn, logp, *args, **kw):
    lp = logp.clone().requires_grad_(True)
    out = fn(lp, *args, **kw)
    loss, metrics = out if isinstance(out, tuple) else (out, {})
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), torch.zeros_like(lp) if grad is None else grad, metrics


def assert_close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=what)


# ----------------------------------------------------------------------------- GMPO vs TRL


class _Accelerator:
    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_gmpo(logp, old, ref, adv, mask, entropy, eps, eps_high, beta, q, steps):
    """TRL's GMPOTrainer._compute_loss on a stub carrying exactly the attributes it reads."""
    from trl.experimental.gmpo import GMPOTrainer
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, T = logp.shape
    stub = SimpleNamespace(
        epsilon_low=eps, epsilon_high=eps_high, beta=beta, top_entropy_quantile=q,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=steps,
        accelerator=_Accelerator(), _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None),
    )  # fmt: skip
    stub.get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask.__get__(stub)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
    }  # fmt: skip
    loss = GMPOTrainer._compute_loss(stub, stub.model, inputs)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


@settings(max_examples=60, deadline=None)
@given(
    batch=batches(),
    eps=st.sampled_from([0.4, 0.2]),
    eps_high=st.sampled_from([None, 0.3]),
    beta=st.sampled_from([0.0, 0.04]),
    q=st.sampled_from([1.0, 0.5]),
    steps=st.integers(1, 3),
)
def test_gmpo_equals_trl_gmpo_trainer(batch, eps, eps_high, beta, q, steps):
    logp, old, ref, adv, mask, entropy = batch
    high = eps if eps_high is None else eps_high
    lp = logp.clone().requires_grad_(True)
    t_loss, t_metrics = trl_gmpo(lp, old, ref, adv, mask, entropy, eps, high, beta, q, steps)
    (t_grad,) = torch.autograd.grad(t_loss, lp)
    o_loss, o_grad, o_metrics = grad_of(
        pv.gmpo_loss, logp, old, adv, mask, epsilon=eps, epsilon_high=eps_high, beta=beta,
        ref_logp=ref, entropy=entropy, top_entropy_quantile=q, gradient_accumulation_steps=steps,
    )  # fmt: skip
    assert_close(o_loss, t_loss.detach(), "loss")
    assert_close(o_grad, t_grad, "grad")
    for key, value in t_metrics.items():
        expected = torch.tensor(value)
        assert_close(o_metrics[key].float(), expected, key) if not math.isnan(value) else None
        assert math.isnan(value) == bool(torch.isnan(o_metrics[key])), key


def test_gmpo_old_none_is_ratio_one_with_its_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    loss, grad, _ = grad_of(pv.gmpo_loss, logp, None, torch.tensor([2.0]), torch.ones(1, 3))
    assert_close(loss, torch.tensor(-2.0))
    assert_close(grad, torch.full((1, 3), -2.0 / 3))  # d(−a·e^{mean l})/dl_t = −a/3


# ----------------------------------------------------------------------------- GSPO-token


def trl_gspo(logp, old, ref, adv, mask, entropy, rho, loss_type, beta, options):
    """TRL's GRPOTrainer._compute_loss at importance_sampling_level "sequence" (GSPO), on a
    stub carrying the attributes it reads (one process, no accumulation)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, T = logp.shape
    args = SimpleNamespace(use_bias_correction_kl=options.get("use_bias_correction_kl", False),
                           delta=options.get("delta"), steps_per_generation=1)  # fmt: skip
    stub = SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.28, beta=beta, loss_type=loss_type, args=args,
        top_entropy_quantile=options.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=options.get("off_policy_mask_threshold"),
        importance_sampling_level="sequence", aux_loss_enabled=False,
        use_vllm=rho is not None, vllm_importance_sampling_correction=rho is not None,
        max_completion_length=T, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(reduce=lambda x, reduction="sum": x, gather=lambda x: x,
                                    pad_across_processes=lambda x, dim=0, pad_index=0: x,
                                    num_processes=1, sync_gradients=True),
        _entropy_bonus_enabled=options.get("entropy_coef", 0.0) != 0.0,
        entropy_coef=options.get("entropy_coef", 0.0), use_adaptive_entropy=False,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None),
    )  # fmt: skip
    stub.get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask.__get__(stub)
    stub.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(), "importance_sampling_ratio": rho,
    }  # fmt: skip
    loss = GRPOTrainer._compute_loss(stub, stub.model, inputs)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


GSPO_OPTIONS = [{}, {"delta": 1.5}, {"off_policy_mask_threshold": 0.5},
                {"top_entropy_quantile": 0.5}, {"use_bias_correction_kl": True},
                {"entropy_coef": 0.01}]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    batch=batches(),
    loss_type=st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]),
    beta=st.sampled_from([0.0, 0.04]),
    options=st.sampled_from(GSPO_OPTIONS),
    ratio=st.sampled_from([None, "row", "token"]),
)
def test_gspo_token_has_trl_gspo_value_and_gradient(batch, loss_type, beta, options, ratio):
    """Its value is TRL's GSPO (importance_sampling_level "sequence", TRL's own code); so is
    its gradient where every weight is per sequence (GSPO-token's s_i·∇logp_t summed over the
    row is GSPO's ∇s_i). Per-token weights give each token its own weight (by hand below)."""
    logp, old, ref, adv, mask, entropy = batch
    B, T = logp.shape
    g = torch.Generator().manual_seed(B * T)
    rho = {None: None, "row": torch.rand(B, 1, generator=g) + 0.5,
           "token": torch.rand(B, T, generator=g) + 0.5}[ratio]  # fmt: skip
    o_loss, o_grad, metrics = grad_of(
        pv.gspo_token_loss, logp, old, adv, mask, ref_logp=ref, loss_type=loss_type, beta=beta,
        epsilon_low=0.2, epsilon_high=0.28, vllm_is_ratio=rho, entropy=entropy,
        num_items_in_batch=mask.sum(), **options,
    )  # fmt: skip
    lp = logp.clone().requires_grad_(True)
    t_loss, t_metrics = trl_gspo(lp, old, ref, adv, mask, entropy, rho, loss_type, beta, options)
    (t_grad,) = torch.autograd.grad(t_loss, lp, allow_unused=True)
    assert_close(o_loss, t_loss.detach(), "loss")
    for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max"):  # fmt: skip
        if key in t_metrics:
            assert_close(metrics[key].float(), torch.tensor(t_metrics[key]), key)
    per_token_weights = ratio == "token" or "top_entropy_quantile" in options
    if not per_token_weights and not options.get("use_bias_correction_kl"):
        assert_close(o_grad, torch.zeros_like(lp) if t_grad is None else t_grad, "grad")


def test_gspo_token_gradient_by_hand():
    """One row, a = 1, unclipped, loss type bnpo, a per-token ρ: ∂L/∂logp_t = −s·ρ_t·a / L."""
    logp = torch.tensor([[-1.0, -1.2, -0.8]])
    old = torch.tensor([[-1.05, -1.1, -0.9]])
    rho = torch.tensor([[0.5, 1.0, 2.0]])
    s = math.exp((logp - old).mean().item())
    loss, grad, _ = grad_of(pv.gspo_token_loss, logp, old, torch.tensor([1.0]), torch.ones(1, 3),
                            loss_type="bnpo", vllm_is_ratio=rho)  # fmt: skip
    assert_close(loss, torch.tensor(-s * 3.5 / 3))
    assert_close(grad, -s * rho / 3)


# ----------------------------------------------------------------------------- verl, by hand


def test_vanilla_dual_clip_by_hand():
    """verl 0.9.1 vanilla, ε 0.2, c 3: r = 4, a = −1 → min(max(4, 1.2), 3) = 3 (no gradient);
    r = 4, a = 1 → max(−4, −1.2) = −1.2 (clipped); r = 1, a = 1 → −1, ∂/∂logp = −1."""
    old = torch.tensor([[-2.0, -2.0, -1.0]])
    logp = old + torch.tensor([[math.log(4.0), math.log(4.0), 0.0]])
    a = torch.tensor([[-1.0, 1.0, 1.0]])
    loss, grad, metrics = grad_of(pvv.vanilla_loss, logp, old, a, torch.ones(1, 3))
    assert_close(loss, torch.tensor((3.0 - 1.2 - 1.0) / 3))
    assert_close(grad, torch.tensor([[0.0, 0.0, -1.0 / 3]]))
    # pg_clipfrac counts −a·clip(r) > −a·r (token 1 only); the dual clip is the _lower one
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(1 / 3))
    assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(1 / 3))


AGG_CASES = {  # x = [[1, 2, 3], [4, 5, 6]], mask = [[1, 1, 0], [1, 0, 0]], plus an empty row
    "token-mean": (1 + 2 + 4) / 3,
    "token-sum": 7.0,
    "seq-mean-token-sum": (3 + 4) / 2,
    "seq-mean-token-sum-norm": (3 + 4) / 2 / 3,
    "seq-mean-token-mean": (1.5 + 4) / 2,
}


@pytest.mark.parametrize("mode", pvv.AGG_MODES)
def test_agg_loss_by_hand(mode):
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(pvv.agg_loss(x, mask, mode), torch.tensor(AGG_CASES[mode]))


def test_agg_loss_global_counts_by_hand():
    x, mask = torch.tensor([[1.0, 2.0]]), torch.ones(1, 2)
    assert_close(pvv.agg_loss(x, mask, "token-mean", dp_size=2, batch_num_tokens=6),
                 torch.tensor(3.0 / 6 * 2))  # fmt: skip
    assert_close(pvv.agg_loss(x, mask, "seq-mean-token-sum-norm", dp_size=2, global_batch_size=4,
                              loss_scale_factor=5), torch.tensor(3.0 / 4 * 2 / 5))  # fmt: skip
    with pytest.raises(ValueError, match="batch_num_tokens"):
        pvv.agg_loss(x, mask, "token-mean", dp_size=2)


def test_geo_mean_by_hand():
    """l = [0.1, 1.0], a = 1, ε 0.2: l~ = [0.1, 0.2], L = −exp(0.3 / 2)."""
    old = torch.tensor([[-1.0, -2.0]])
    logp = old + torch.tensor([[0.1, 1.0]])
    loss, grad, metrics = grad_of(pvv.geo_mean_loss, logp, old, torch.ones(1, 2), torch.ones(1, 2))
    assert_close(loss, torch.tensor(-math.exp(0.15)))
    assert_close(grad, torch.tensor([[-math.exp(0.15) / 2, 0.0]]))
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.5))


def test_dppo_masks_by_hand():
    """p_old 0.5: p 0.8 (a > 0, p − p_old 0.3 > 0.2: dropped), p 0.6 (kept, ∂ = −a·r̂ with
    r̂ = 1.2), p 0.2 (a < 0, p − p_old −0.3 < −0.2: dropped)."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.8, 0.6, 0.2]]))
    a = torch.tensor([[1.0, 1.0, -1.0]])
    loss, grad, metrics = grad_of(pvp.dppo_tv_loss, logp, old, a, torch.ones(1, 3))
    assert_close(loss, torch.tensor(-1.2 * math.log(0.6) / 3))
    assert_close(grad, torch.tensor([[0.0, -1.2 / 3, 0.0]]))
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(2 / 3))


def test_dro_and_gpg_by_hand():
    logp, old, a = torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([[2.0]])
    loss, grad, _ = grad_of(pvp.dro_loss, logp, old, a, torch.ones(1, 1), dro_beta=0.4)
    assert_close(loss, torch.tensor(-(-2.0 - 0.5 * 0.4 * 0.25)))
    assert_close(grad, torch.tensor([[-(2.0 - 0.4 * 0.5)]]))
    loss, grad, _ = grad_of(pvp.gpg_loss, logp, None, a, torch.ones(1, 1))
    assert_close(loss, torch.tensor(2.0))


def test_gpg_advantages_by_hand():
    """R = [1, 0, 1, 1] in groups [a, a, b, b]: α = 4/3; a − mean: [0.5, −0.5, 0, 0]."""
    adv = pvp.gpg_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(4, 2), list("aabb"))
    assert_close(adv, (4 / 3 * torch.tensor([0.5, -0.5, 0.0, 0.0]))[:, None].expand(4, 2))


def test_kl_cov_penalises_the_top_covariance_token():
    """cov = (a − ā)(logp − mean logp) = [0.825, −1.075, 0.575, −0.825]: token 0 alone gets
    +c·|l| (k = max(⌊0.2·4⌋, 1) = 1)."""
    logp = torch.tensor([[-0.1, -2.0], [-1.5, -0.1]])
    old = logp - 0.5
    a = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, _, _ = grad_of(pvp.kl_cov_loss, logp, old, a, torch.ones(2, 2), kl_cov_ratio=0.2)
    r = math.exp(0.5)
    assert_close(loss, torch.tensor((-r + 0.1 * 0.5 - r + r + r) / 4))


def test_clip_cov_zeroes_exactly_the_drawn_tokens():
    logp = torch.tensor([[-0.1, -3.0, -0.2]])
    old = logp.clone()
    a = torch.tensor([[3.0, -3.0, 3.0]])
    keep = pvv.draw_clip_cov_keep(logp, old, a, torch.ones(1, 3), clip_cov_ratio=0.5,
                                  generator=torch.Generator().manual_seed(0))  # fmt: skip
    # cov = (a − 1)(logp − mean logp): 2·1.0, −4·(−1.9), 2·0.9 → only token 0 lies in (1, 5)
    assert keep.tolist() == [[0.0, 1.0, 1.0]]
    loss, _, metrics = grad_of(pvv.clip_cov_loss, logp, old, a, torch.ones(1, 3),
                               clip_cov_keep=keep)  # fmt: skip
    assert_close(loss, torch.tensor((0.0 + 3.0 - 3.0) / 3))
    assert_close(metrics["actor/pg_clipfrac"], torch.tensor(1 / 3))


# ----------------------------------------------------------------------------- M2PO


def test_m2po_tau_by_hand():
    """Harmful Δ² = [0.01, 0.04, 0.09, 0.36] (a > 0, r > 1), M2 0.125 > 0.04, target 0.16:
    k = 2 is the first with (v_k)(n − k − 1) + Σ_{j≤k} v_j ≥ 0.16 (0.04, 0.13, 0.23), τ² = v_1 =
    0.04, so ε_low = 1 − e^−0.2, ε_high = e^0.2 − 1, M2 after = (0.04·2 + 0.05)/4."""
    old = torch.full((1, 5), -1.0)
    logp = old + torch.tensor([[0.1, 0.2, 0.3, 0.6, -0.7]])  # the last is harmless (a > 0, r < 1)
    low, high, stats = m2po.m2po_clip_range(logp, old, torch.ones(1), torch.ones(1, 5), 0.04)
    assert low == pytest.approx(1 - math.exp(-0.2), abs=1e-6)
    assert high == pytest.approx(math.exp(0.2) - 1, abs=1e-6)
    assert float(stats["m2po/M2"]) == pytest.approx(0.125, abs=1e-6)
    assert float(stats["m2po/M2_after"]) == pytest.approx(0.0325, abs=1e-6)
    loss, grad, metrics = grad_of(m2po.m2po_loss, logp, old, torch.ones(1), torch.ones(1, 5))
    r = torch.exp(logp - old)[0]
    clipped = r.clamp(max=math.exp(0.2))
    assert_close(loss, -clipped.mean())
    assert_close(grad[0], torch.where(r > math.exp(0.2), 0.0, -r / 5))
    assert float(metrics["m2po/clip_high"]) == pytest.approx(high)


def test_m2po_within_budget_does_not_clip():
    old = torch.zeros(2, 3) - 1.0
    logp = old + 0.05
    low, high, _ = m2po.m2po_clip_range(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    assert (low, high) == (1.0, m2po.NO_CLIP - 1.0)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, m: pvv.agg_loss(x, m, "mean"), "loss_agg_mode: expected one of 'token-mean'"),
        (lambda x, m: pvp.dro_loss(x, x, x, m, dro_beta=None), "dro_beta"),
        (lambda x, m: pvv.vanilla_loss(x, x, x, m, clip_ratio_c=1.0), "clip_ratio_c"),
        (lambda x, m: m2po.m2po_loss(x, x, x, m, clip_loss="gpg"), "clip_loss: expected one of"),
        (lambda x, m: m2po.m2po_loss(x, x, x, m, M2_budget=0.0), "M2_budget"),
        (lambda x, m: pv.gspo_token_loss(x, x, x[:, 0], m, loss_type="cispo"), "loss_type"),
        (lambda x, m: pv.gmpo_loss(x, x, x[:, 0], m, beta=0.1), "ref_logp"),
        (lambda x, m: pv.gmpo_loss(x, x, x[:, 0], m, top_entropy_quantile=0.5), "entropy"),
        (lambda x, m: pvp.kl_cov_loss(x, x, x, m, kl_cov_ratio=0.0), "kl_cov_ratio"),
    ],
)
def test_bad_options_name_the_argument(call, match):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        call(x, torch.ones(2, 3))


def test_float64_stays_float64_and_inputs_are_untouched():
    logp = torch.tensor([[-1.0, -30.0]], dtype=torch.float64)
    old = torch.tensor([[-31.0, 0.0]], dtype=torch.float64)
    before = logp.clone(), old.clone()
    for fn in (pvv.vanilla_loss, pvp.dppo_kl_loss, pvp.kl_cov_loss, m2po.m2po_loss):
        loss, grad, _ = grad_of(fn, logp, old, torch.ones(1, 2, dtype=torch.float64),
                                torch.ones(1, 2))  # fmt: skip
        assert loss.dtype == torch.float64 and torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(logp, before[0]) and torch.equal(old, before[1])
