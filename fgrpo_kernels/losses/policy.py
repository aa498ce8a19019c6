"""The policy-loss variants on the fused head: GMPO (TRL's GMPOTrainer), GSPO-token, verl's
registry (vanilla with dual clip, gspo, clip_cov, geo_mean, gpg, dro, dppo_tv, dppo_kl,
kl_cov) and M2PO, each with the shared rollout correction and a KL term of any estimator.

A variant is one entry of `VARIANTS`: its plain-PyTorch loss on per-token log-probs
(`core.policy_variants*`, `core.policy_m2po`), whose autograd gives dL/dlogp; the fused head
gives the log-probs and their gradient without [N, V] on every backend (torch, C++, Triton).
A variant whose token's dL/dlogp needs that token alone (given the batch's mask, counted up
front) or its own sequence takes the single pass (6·N·H·V, `single_pass`): each chunk's gradient
is autograd of the variant on the whole batch with the chunk's log-probs live and the other
tokens at their old log-probs, which for such a loss leaves the chunk's gradient exactly as on
the whole batch. kl_cov (a top-k of the batch's covariance) and M2PO (a clip range from the
whole batch's log-ratios) need every current log-prob: their chunks take that provisional
gradient, and the sweep's end corrects the tokens where the whole batch's differs
(`Locality.BATCH`: kl_cov's top-k, the tokens M2PO's τ clips), which cost their logits again.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..core import policy_m2po, policy_variants, policy_variants_verl, policy_variants_verl_pg
from ..core import validation as check
from ..core.kl_estimators import KLPenalty
from ..core.policy_variants_verl import AGG_MODES, agg_loss
from ..core.rollout_correction import rollout_correction
from ..head.batch import Batch
from ..head.options import split
from . import rollout, single_pass
from .pipeline import FusedLoss, LossStep
from .single_pass import Locality

# A variant's arguments that the module fills in itself, and those that come with each call.
FILLED = ("logp", "old_logp", "advantages", "mask", "ref_logp", "entropy", "rollout_is_weights")
PER_CALL = (
    "clip_cov_keep",
    "global_batch_info",
    "num_items_in_batch",
    "vllm_is_ratio",
    "sampling_logp",
)


# the IS weights a variant takes, by the name it takes them under
WEIGHTS = ("rollout_is_weights", "vllm_is_ratio")


@dataclass(frozen=True)
class Variant:
    """One policy loss: `fn(logp, old_logp, advantages, mask, **kw) -> (loss, metrics)`;
    `source` names whose semantics it follows ("trl", "verl", "m2po"); `locality`: what a
    token's dL/dlogp depends on (`single_pass.Locality`), or why it has no single pass (str);
    `token_part` (a sequence-local one): u_t of its dL/dlogp_t = c_i·u_t from the token's own
    numbers (`core.policy_variants`, "token parts"), or None."""

    fn: Callable
    source: str
    locality: Locality | str
    token_part: Callable | None = None

    def parameters(self) -> dict:
        return dict(_parameters(self.fn))

    def options(self) -> tuple[str, ...]:
        return tuple(p for p in self.parameters() if p not in FILLED + PER_CALL)

    def takes(self, name: str) -> bool:
        return name in self.parameters()

    def resolved(self, options: dict) -> SimpleNamespace:
        """Every option by name: `options` over the defaults of the signature."""
        params = self.parameters()
        defaults = {k: params[k].default for k in self.options()
                    if params[k].default is not inspect.Parameter.empty}  # fmt: skip
        return SimpleNamespace(**{**defaults, **options})

    def required(self) -> tuple[str, ...]:
        """The options without a default (dro's dro_beta): the constructor must get them."""
        params = self.parameters()
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return tuple(
            k
            for k in self.options()
            if params[k].kind in named and params[k].default is inspect.Parameter.empty
        )


@functools.cache
def _parameters(fn: Callable):
    """fn's signature's parameters, read once (each chunk's gradient asks what a variant takes:
    inspect.signature cost ~0.1 ms a call)."""
    return inspect.signature(fn).parameters


VERL_LOCALITY = {
    "vanilla": Locality.TOKEN,
    "gspo": Locality.ROW,
    "clip_cov": Locality.TOKEN,  # its random choice of tokens comes in as clip_cov_keep
    "geo_mean": Locality.ROW,
    "gpg": Locality.TOKEN,
    "dro": Locality.TOKEN,
    "dppo_tv": Locality.TOKEN,
    "dppo_kl": Locality.TOKEN,
    "kl_cov": Locality.BATCH,  # the top-k of the batch's token covariance
}
# the sequence-local variants' token parts (`Variant.token_part`)
TOKEN_PARTS = {
    "gmpo": policy_variants.gmpo_token_part,
    "gspo_token": policy_variants.sequence_ratio_token_part,
    "gspo": policy_variants.sequence_ratio_token_part,
    "geo_mean": policy_variants_verl.geo_mean_token_part,
}
VARIANTS: dict[str, Variant] = {
    "gmpo": Variant(policy_variants.gmpo_loss, "trl", Locality.ROW, TOKEN_PARTS["gmpo"]),
    "gspo_token": Variant(
        policy_variants.gspo_token_loss, "trl", Locality.ROW, TOKEN_PARTS["gspo_token"]
    ),
    **{
        name: Variant(fn, "verl", VERL_LOCALITY[name], TOKEN_PARTS.get(name))
        for name, fn in policy_variants_verl_pg.POLICY_LOSSES.items()
    },
    "m2po": Variant(policy_m2po.m2po_loss, "m2po", Locality.BATCH),  # τ from the whole batch
}


def _per_token_flat(t: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """t [B], [B, 1] or [B, T] as [B·T], each row's value on each of its tokens."""
    return (t[:, None] if t.dim() == 1 else t).expand(B, T).reshape(-1)


def variant(loss_mode: str) -> Variant:
    if loss_mode not in VARIANTS:
        raise ValueError(
            f"loss_mode: expected one of {', '.join(map(repr, VARIANTS))}; got {loss_mode!r}"
        )
    return VARIANTS[loss_mode]


class PolicyStep(LossStep):
    """A variant on one batch: rollout correction, the variant's loss, the KL term."""

    def __init__(self, module, batch: Batch, advantages, old, ref, rollout, inputs, ret_entropy):
        self.module, self.mask = module, batch.mask
        self.adv = advantages.detach()
        self.old = None if old is None else old.detach()
        self.ref, self.rollout, self.inputs = ref, rollout, inputs
        self.return_entropy = ret_entropy
        self.need_entropy = module.compute_entropy or ret_entropy or module.needs_entropy
        self.extra = {}

    def chunked(self):
        why = self._no_single_pass()
        if why is not None:
            return f"loss_mode={self.module.loss_mode!r}: {why}"
        rc, old = self.module.rollout_correction, self.old
        corrected = (
            None if rc is None else rollout_correction(old, old, self.rollout, self.mask, rc)
        )
        base = torch.zeros(self.mask.shape, device=self.mask.device) if old is None else old

        def grad(rows, m, lp, ent):
            with torch.enable_grad():
                full = base.to(lp.dtype).clone()
                full[rows] = torch.where(m.bool(), lp, full[rows])
                live = [full.requires_grad_()]
                if ent is not None:
                    ent_full = full.new_zeros(full.shape)
                    ent_full[rows] = ent.to(full.dtype)
                    live.append(ent_full.requires_grad_())
                loss = self.loss_of(full, live[1] if ent is not None else None, corrected)[0]
                grads = [None] * len(live)
                if loss.requires_grad:  # not where the chunk's rows hold no token of the loss
                    grads = torch.autograd.grad(loss, live, allow_unused=True)
            d = [None if g is None else g[rows] for g in grads]
            return torch.zeros_like(lp) if d[0] is None else d[0], d[1] if ent is not None else None

        def value(lp, ent):
            loss, self.extra = self.loss_of(lp, ent, corrected)
            return loss.detach()

        locality = self.module.variant.locality
        if locality == Locality.ROW and self._log_ratios_vanish():
            locality = Locality.TOKEN
        scaled = self._row_scaled()
        part = self._token_part(corrected, old) if scaled and locality == Locality.ROW else None
        return single_pass.ChunkedLoss(locality, grad, value, scaled=scaled, token_part=part)

    def _token_part(self, corrected, old):
        """`ChunkedLoss.token_part` of a variant that has one (`Variant.token_part`): its u_t on
        the flat tokens, from per-token tensors laid out once; else None."""
        fn = self.module.variant.token_part
        if fn is None:
            return None
        kw, mask, _ = self._call_inputs(corrected)
        shape = mask.shape
        w = next((kw[k] for k in WEIGHTS if kw.get(k) is not None), None)
        w = None if w is None else _per_token_flat(w, *shape)
        a, m = _per_token_flat(self.adv, *shape), mask.reshape(-1)
        old = None if old is None else old.reshape(-1)
        opts = self.module.variant.resolved(self.module.options)

        def part(idx, lp):
            dtype = policy_variants.compute_dtype(lp, old, a, w)
            lp = lp.to(dtype)
            # no old log-probs: they are the current ones, every log-ratio 0
            lr = torch.zeros_like(lp) if old is None else lp - old[idx].to(dtype)
            ww = None if w is None else w[idx].to(dtype)
            return fn(lr, a[idx].to(dtype), m[idx].to(dtype), ww, opts)

        return part

    def _log_ratios_vanish(self) -> bool:
        """No old log-probs (they are the current ones, detached: TRL's num_iterations=1) and no
        sampler's: every log-ratio is 0 whatever the other tokens, so a sequence's factor
        (GSPO's ratio, GMPO's geometric mean: exp of a mean of zeros) is 1 and a token's
        dL/dlogp needs that token alone (its row's mask counted up front): the sequence-local
        variants then chunk as token-local ones."""
        return self.old is None and self.inputs.get("sampling_logp") is None

    def _row_scaled(self) -> bool:
        """The sequence-local variants' dL/dlogp_t is c_i·u_t (GSPO's clipped sequence ratio,
        GMPO's geometric mean, times a token's mask, clip and weights); a KL term or an entropy
        bonus adds a token-local term, which the single pass's open rows cannot scale."""
        m = self.module
        return m.kl_coef == 0.0 and not any(m.options.get(k, 0.0) for k in ("beta", "entropy_coef"))

    def _no_single_pass(self) -> str | None:
        m = self.module
        if isinstance(m.variant.locality, str):
            return m.variant.locality
        if self.return_entropy:
            return single_pass.RETURNED_ENTROPY
        if m.options.get("top_entropy_quantile", 1.0) < 1.0:
            return single_pass.ENTROPY_MASK
        rc = m.rollout_correction
        if rc is not None and (rc.bypass or self.old is None):
            return (
                "rollout_correction without old_per_token_logps (or in bypass mode) weighs by "
                "the current log-probs"
            )
        return None

    def two_pass(self, logps, ent):
        m = self.module
        old = logps.detach() if self.old is None else self.old
        corrected = None
        if m.rollout_correction is not None:
            corrected = rollout_correction(
                logps, old, self.rollout, self.mask, m.rollout_correction
            )
        loss, self.extra = self.loss_of(logps, ent, corrected)
        return loss

    def loss_of(self, logps, ent, corrected):
        """(loss, metrics) of the variant and the KL term on log-probs [B, T], with the
        rollout correction's (weights, mask, metrics) or None."""
        m = self.module
        old = logps.detach() if self.old is None else self.old
        kw, mask, extra = self._call_inputs(corrected)
        if m.variant.takes("ref_logp"):
            kw["ref_logp"] = self.ref
        if m.variant.takes("entropy") and ent is not None:
            kw["entropy"] = ent
        loss, metrics = m.variant.fn(logps, old, self.adv, mask, **m.options, **kw)
        if m.kl_coef != 0.0:
            kl = m.kl_penalty(logps, self.ref, mask)
            kl_loss = agg_loss(kl, mask, m.kl_agg_mode)
            loss = loss + m.kl_coef * kl_loss
            metrics = {
                **metrics,
                "actor/kl_loss": kl_loss.detach(),
                "actor/kl_coef": torch.tensor(m.kl_coef),
            }
        return loss, {**metrics, **extra}

    def _call_inputs(self, corrected):
        """(the variant's per-call keywords, the mask, the correction's metrics): with the rollout
        correction's (weights, mask, metrics), its weights under the variant's argument and its
        rejection in the mask."""
        kw, mask, extra = dict(self.inputs), self.mask, {}
        if corrected is not None:
            weights, mask, extra = corrected
            if self.module.rollout_correction.applies_weights:
                kw[self.module.weights_arg] = weights
        return kw, mask, extra

    def metrics(self, loss, logps, ent):
        out = {"loss": loss.detach(), **self.extra}
        if ent is not None and "entropy" not in out:
            live = self.mask.bool()
            out["entropy"] = ent.detach()[live].float().mean() if live.any() else ent.new_zeros(())
        return out


class FusedLinearPolicyLoss(FusedLoss):
    """A policy-loss variant on hidden states (`VARIANTS`; SPEC: docs/variants.md).

    `loss_mode`: "gmpo", "gspo_token", verl's "vanilla", "gspo", "clip_cov", "geo_mean", "gpg",
    "dro", "dppo_tv", "dppo_kl", "kl_cov", or "m2po"; `options` are the variant's own keywords
    under its source's names and defaults (verl's clip_ratio, clip_ratio_c, loss_agg_mode, ...;
    TRL's epsilon, beta, loss_type, ...); an unknown name is a TypeError listing the valid ones.
    `rollout_correction`: a `RolloutCorrection` or a dict of verl's, OpenRLHF's or TRL's names
    (forward then needs `rollout_per_token_logps`, the sampler's log-probs). `kl_coef` with
    `kl_penalty` (an estimator name: k1, abs, k2, k3, low_var_kl, or a "+" form, or a
    `KLPenalty`): verl's KL loss, kl_coef·agg(kl, loss_agg_mode), needs the reference log-probs.

    Forward: hidden [B, T, H], weight [V, H], completion_ids / completion_mask [B, T],
    advantages [B] (or [B, T] where the source allows), old / ref / rollout per-token log-probs
    [B, T] (old defaults to the current ones, detached), and the variant's per-call inputs by
    name (clip_cov_keep, global_batch_info, num_items_in_batch, vllm_is_ratio, sampling_logp).
    Returns (loss, metrics), or (loss, metrics, entropy [B, T]) with `return_entropy=True`.
    """

    def __init__(
        self,
        loss_mode="vanilla",
        *,
        rollout_correction=None,
        kl_coef=0.0,
        kl_penalty="k3",
        temperature=1.0,
        compute_entropy=False,
        fast_fp32=False,
        **options,
    ):
        head, options = split(options)  # the other HeadOptions (vocab_parallel, ...) by keyword
        super().__init__(temperature, compute_entropy, fast_fp32, **head)
        if self.head.process_group is not None:
            raise ValueError(
                "process_group: the policy variants take the whole batch on one process; pass "
                "verl's global_batch_info (dp_size, batch_num_tokens, global_batch_size) instead"
            )
        self.loss_mode, self.variant = loss_mode, variant(loss_mode)
        self.options = self._options(options)
        if loss_mode == "m2po":  # the clip M2PO sets must exist before the first batch
            check.choice("clip_loss", self.options.get("clip_loss", "ppo"), policy_m2po.CLIP_LOSSES)
        self.rollout_correction = self._rollout(rollout_correction)
        self.kl_coef = check.real("kl_coef", kl_coef)
        self.kl_penalty = KLPenalty.parse(kl_penalty)
        self.kl_agg_mode = self.options.get("loss_agg_mode", "token-mean")
        check.choice("loss_agg_mode", self.kl_agg_mode, AGG_MODES)
        quantile = self.options.get("top_entropy_quantile", 1.0)
        self.needs_entropy = self.variant.takes("entropy") and (
            quantile < 1.0 or self.options.get("entropy_coef", 0.0) != 0.0
        )

    def _options(self, options: dict) -> dict:
        valid = self.variant.options()
        takes_any = any(p.kind == p.VAR_KEYWORD for p in self.variant.parameters().values())
        unknown = [k for k in options if k not in valid and not takes_any]
        if unknown:
            raise TypeError(
                f"{unknown[0]}: not an option of loss_mode={self.loss_mode!r}; expected one of "
                f"{', '.join(valid)}"
            )
        missing = [k for k in self.variant.required() if k not in options]
        if missing:
            raise TypeError(
                f"{missing[0]}: loss_mode={self.loss_mode!r} requires it (it has no default)"
            )
        return dict(options)

    def _rollout(self, options):
        opts = rollout.options_of(options)
        if opts is None:
            return None
        self.weights_arg = next((a for a in WEIGHTS if self.variant.takes(a)), None)
        if opts.applies_weights and self.weights_arg is None:
            raise ValueError(
                f"rollout_correction: loss_mode={self.loss_mode!r} takes no IS weights (its "
                "source has none); use a rejection-only correction (rollout_is=None)"
            )
        return opts

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        advantages,
        bias=None,
        *,
        old_per_token_logps=None,
        ref_per_token_logps=None,
        rollout_per_token_logps=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
        return_entropy=False,
        **inputs,
    ):
        batch = self.batch(hidden, weight, completion_ids, completion_mask, bias)
        self._check_inputs(batch, advantages, old_per_token_logps, rollout_per_token_logps, inputs)
        ref = batch.given_or_computed(
            self.head, "ref_per_token_logps", ref_per_token_logps, ref_hidden, ref_weight, ref_bias
        )
        needs_ref = self.kl_coef != 0.0 or (
            self.variant.takes("ref_logp") and self.options.get("beta", 0.0) != 0.0
        )
        if needs_ref and ref is None:
            raise ValueError(
                "ref_per_token_logps: expected [B, T] reference log-probs (or "
                "ref_hidden) with a KL term (kl_coef or beta != 0); got None"
            )
        step = PolicyStep(self, batch, advantages, old_per_token_logps, ref,
                          rollout_per_token_logps, inputs, return_entropy)  # fmt: skip
        return self.run(batch, step)

    def _check_inputs(self, batch: Batch, advantages, old, rollout, inputs: dict) -> None:
        B, T = batch.B, batch.T
        check.tensor("advantages", advantages, floating=True)
        if tuple(advantages.shape) not in ((B,), (B, T)):
            raise ValueError(
                f"advantages: expected [B] or [B, T] = [{B}] or [{B}, {T}]; got "
                f"{list(advantages.shape)}"
            )
        check.finite("advantages", advantages, None if advantages.dim() == 1 else batch.mask)
        batch.optional_logps("old_per_token_logps", old)
        unknown = [k for k in inputs if k not in PER_CALL or not self.variant.takes(k)]
        if unknown:
            takes = [k for k in PER_CALL if self.variant.takes(k)]
            raise TypeError(
                f"{unknown[0]}: not an input of loss_mode={self.loss_mode!r}; "
                f"expected one of {', '.join(takes) or 'none'}"
            )
        if self.rollout_correction is not None:
            batch.per_token_logps("rollout_per_token_logps", rollout)
