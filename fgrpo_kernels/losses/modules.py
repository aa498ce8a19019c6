"""Fused modules: hidden states and the lm_head in, (loss, metrics) out (docs/math.md).

Each module computes the per-token log-probs with the fused kernel (never the [N, V] logits),
then runs the loss epilogue, which returns the loss and dL/dlogp in one pass; backward feeds
dL/dlogp · grad_output to the log-prob backward. `metrics` is a dict of detached scalars.

Shapes: hidden [B, T, H], weight [V, H], completion_ids / completion_mask [B, T],
advantages / rewards [B], per-token log-probs [B, T].

Every module also takes `vocab_parallel=VocabParallel(...)` (weight and bias are this rank's
shard of the vocabulary; completion ids stay global) and `process_group=` (this rank holds a
slice of a data-parallel batch, in rank order: the normalisers, group statistics and pool
sizes are the whole batch's, and each rank's loss is its share times the group size, so the
mean over ranks — what DDP's gradient averaging takes — is the whole batch's loss; see
docs/math.md §7). A DTensor weight or bias (FSDP2) is gathered once per call.
"""

from __future__ import annotations

import torch

from ..backends import distributed
from ..backends.distributed import VocabParallel
from ..core import grpo_math, reference
from ..core import validation as check
from ..core.options import FGRPOOptions, GIFTOptions, GRPOOptions, Level, LogProbOptions, Reduction
from ..head.autograd import EpilogueFunction
from ..head.logprobs import fused_linear_logprobs
from . import epilogue, metrics, single_pass

# Why a module takes the two-pass path (docs/math.md §5, "Single pass").
RETURNED_ENTROPY = (
    "return_entropy=True: the entropy is returned with its gradient, whose upstream is not known "
    "in the forward"
)
ENTROPY_MASK = (
    "top_entropy_quantile < 1: the entropy mask's threshold is a quantile of the whole batch's "
    "entropies"
)
VOCAB_PARALLEL = "vocab_parallel: a chunk's log-sum-exp needs every rank's shard of the vocabulary"


class _FusedLinearLoss(torch.nn.Module):
    """Shared plumbing: options, the policy log-probs, the optional in-call reference pass, and
    the choice between the single pass and the two-pass path (`last_pass` says which ran)."""

    def __init__(
        self, temperature=1.0, compute_entropy=False, fast_fp32=False, vocab_parallel=None,
        process_group=None, max_chunk_bytes=None,
    ):  # fmt: skip
        super().__init__()
        self.temperature = check.temperature(temperature)
        self.compute_entropy = bool(compute_entropy)
        self.fast_fp32 = bool(fast_fp32)
        if vocab_parallel is not None and not isinstance(vocab_parallel, VocabParallel):
            raise TypeError(
                f"vocab_parallel: expected a VocabParallel or None; got {type(vocab_parallel)}"
            )
        self.vocab_parallel = vocab_parallel
        self.process_group = process_group
        self.max_chunk_bytes = check.byte_count("max_chunk_bytes", max_chunk_bytes)
        self.last_pass = None

    def _head(self, weight, bias):
        """The lm_head as plain tensors: a DTensor (FSDP2) weight or bias gathered once."""
        if distributed.is_dtensor(weight):
            weight = distributed.gather_dtensor(weight, "weight")
        if distributed.is_dtensor(bias):
            bias = distributed.gather_dtensor(bias, "bias")
        return weight, bias

    def _vocab_size(self, weight) -> int | None:
        """The global V under vocabulary parallelism (ids are global), else None."""
        if self.vocab_parallel is None:
            return None
        check.tensor("weight", weight, ndim=2)
        return distributed.resolve(self.vocab_parallel, weight.shape[0], weight.device).total

    def _batch(self, hidden, weight, ids, mask, bias, prefix=""):
        """(hidden's B, T, weight, bias) after the checks, the lm_head gathered if sharded."""
        weight, bias = self._head(weight, bias)
        B, T, _, _ = check.linear_batch(
            hidden, weight, ids, mask, bias, prefix=prefix, vocab_size=self._vocab_size(weight)
        )
        return B, T, weight, bias

    def _data_parallel(self):
        """(group, world size), or None without a process_group."""
        group = distributed.check_group(self.process_group)
        return None if group is None else (group, distributed.dist.get_world_size(group))

    def _share(self, loss, local, total, world):
        """A rank's share of a mean over the data-parallel batch, times the group size: the
        mean over ranks is then the whole batch's loss."""
        return loss * (world * float(local) / max(float(total), 1.0))

    def _tokens(self, hidden, ids, mask):
        """(positions [N], hidden [N, H], targets [N]) of the unmasked tokens, row-major."""
        B, T, H = hidden.shape
        positions = mask.reshape(-1).bool().nonzero().squeeze(1)
        if len(positions) == B * T:  # every token counts: a view, no copy (nor its gradient's)
            return positions, hidden.reshape(B * T, H), ids.reshape(-1)
        rows = hidden.reshape(B * T, H).index_select(0, positions)
        return positions, rows, ids.reshape(-1).index_select(0, positions)

    def _lp_opts(self) -> LogProbOptions:
        return LogProbOptions(self.temperature, -100, self.fast_fp32)

    def _logps(self, hidden, weight, ids, mask, bias, entropy=False):
        """Per-token log-probs [B, T] and, with `entropy`, entropies [B, T] (both 0 where masked,
        both differentiable); only unmasked rows reach the kernel."""
        B, T, H = hidden.shape
        positions, rows, targets = self._tokens(hidden, ids, mask)
        out = fused_linear_logprobs(
            rows,
            weight,
            targets,
            bias,
            self.temperature,
            return_entropy=entropy,
            fast_fp32=self.fast_fp32,
            vocab_parallel=self.vocab_parallel,
        )
        logp, ent = out if entropy else (out, None)

        def scatter(x):
            return x.new_zeros(B * T).index_copy(0, positions, x).reshape(B, T)

        return scatter(logp), None if ent is None else scatter(ent)

    def _single_pass(self, hidden, weight, ids, mask, bias, chunked, entropy=False):
        """(loss, logps [B, T], entropy [B, T] | None) by the single pass (`chunked()` builds
        the loss's `single_pass.ChunkedLoss`, or says why it cannot), or None when the
        two-pass path must run; `last_pass` records the choice and its reason."""
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, weight, bias)
        )
        if not wants_grad:
            self.last_pass = "two-pass: no gradient is wanted (a forward alone is one pass)"
            return None
        if self.vocab_parallel is not None:
            self.last_pass = f"two-pass: {VOCAB_PARALLEL}"
            return None
        max_bytes = single_pass.chunk_bytes(self.max_chunk_bytes, hidden.device)
        loss = chunked() if max_bytes else None
        lengths = mask.bool().sum(-1).tolist()
        how = single_pass.plan(hidden, weight, lengths, loss, max_bytes)
        if isinstance(how, str):
            self.last_pass = f"two-pass: {how}"
            return None
        positions, rows, targets = self._tokens(hidden, ids, mask)
        check.logprob_inputs(rows, weight, targets, bias, self.temperature, -100)
        self.last_pass = "single"
        bias = None if bias is None else bias.contiguous()
        return single_pass.run(*how, rows, weight.contiguous(), targets, bias, self._lp_opts(),
                               positions, mask, loss, entropy)  # fmt: skip

    def _given_or_computed(self, name, given, hidden, weight, bias, ids, mask, B, T):
        """Per-token log-probs passed in, or computed forward-only from (hidden, weight, bias)
        — the Liger convention for an in-call reference model."""
        if given is not None:
            check.tensor(name, given, shape=(B, T), floating=True)
            return given.detach()
        if hidden is None:
            return None
        weight, bias = self._head(weight, bias)
        check.tensor("ref_hidden", hidden, shape=(B, T, None), floating=True)
        check.tensor("ref_weight", weight, shape=(None, hidden.shape[-1]), floating=True)
        if bias is not None:
            check.tensor("ref_bias", bias, shape=(weight.shape[0],), floating=True)
        with torch.no_grad():
            return self._logps(hidden, weight, ids, mask, bias)[0]


class FusedLinearFGRPOLoss(_FusedLinearLoss):
    """f-GRPO on hidden states: |a_i|·φ_{sign a_i}(β·log π/π_ref) per token or sequence.

    Pass exactly one of `advantages` [B] or `rewards` [B] (then `num_generations` is needed and
    the group normalisation is fused into the epilogue, with `scale_rewards`, `eps`,
    `unbiased`). Reference log-probs come as `ref_per_token_logps` [B, T] or are computed in the
    call from `ref_hidden` (and `ref_weight`, `ref_bias`; default: the policy's lm_head).
    `group_is_weights=True` applies the f-GRPO paper's group importance weights (needs rewards;
    old log-probs default to the current ones, detached). `vllm_is_ratio` (forward) ρ weights
    each unit's cost; `entropy_coef` c subtracts c·(masked mean entropy), with its gradient.
    `return_entropy=True` (forward) also returns the per-token entropy [B, T], differentiable.
    """

    def __init__(
        self,
        divergence="pearson",
        beta=0.1,
        level="token",
        reduction=None,
        num_generations=None,
        temperature=1.0,
        scale_rewards="group",
        eps=1e-4,
        unbiased=True,
        group_is_weights=False,
        compute_entropy=False,
        fast_fp32=False,
        *,
        entropy_coef=0.0,
        vocab_parallel=None,
        process_group=None,
        max_chunk_bytes=None,
    ):
        super().__init__(
            temperature, compute_entropy, fast_fp32, vocab_parallel, process_group, max_chunk_bytes
        )
        self.opts = FGRPOOptions.parse(
            divergence, beta, level, reduction, num_generations, scale_rewards, eps, unbiased,
            group_is_weights, entropy_coef=entropy_coef, scale_arg="scale_rewards",
        )  # fmt: skip

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        *,
        advantages=None,
        rewards=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        bias=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        return_entropy=False,
    ):
        opts = self.opts
        B, T, weight, bias = self._batch(hidden, weight, completion_ids, completion_mask, bias)
        check.is_ratio("vllm_is_ratio", vllm_is_ratio, B, T, per_token=opts.level == Level.TOKEN)
        if advantages is not None and rewards is not None and not opts.group_is_weights:
            raise ValueError("advantages: expected exactly one of advantages or rewards; got both")
        dp = self._data_parallel()
        counts = None
        if dp is not None:
            counts = distributed.global_sum([B, float(completion_mask.sum())], dp[0])
            if opts.group_is_weights and opts.num_generations and B % opts.num_generations:
                raise ValueError(
                    f"process_group: group_is_weights needs whole groups on every rank; got {B} "
                    f"completions here with num_generations={opts.num_generations}"
                )
            if opts.entropy_coef != 0.0 and opts.reduction != Reduction.TOKEN_MEAN:
                raise ValueError(
                    "process_group: entropy_coef with a data-parallel batch needs "
                    "reduction='token_mean' (one normaliser for the loss and the bonus)"
                )
        check.advantages_or_rewards(
            advantages, rewards, opts.num_generations, B, need_rewards=opts.group_is_weights,
            groups_of=None if dp is None else int(counts[0]),
        )  # fmt: skip
        if dp is not None and advantages is None and not opts.group_is_weights:
            advantages = self._global_advantages(rewards, dp)
            rewards = None
        check.optional_per_token("old_per_token_logps", old_per_token_logps, B, T)
        ref = self._given_or_computed(
            "ref_per_token_logps",
            ref_per_token_logps,
            ref_hidden,
            weight if ref_weight is None else ref_weight,
            ref_bias,
            completion_ids,
            completion_mask,
            B,
            T,
        )
        if ref is None:
            raise ValueError(
                "ref_per_token_logps: expected [B, T] reference log-probs (or ref_hidden); got None"
            )
        adv = None if advantages is None else advantages.detach().float()
        rw = None if rewards is None else rewards.detach().float()
        given_old = None if old_per_token_logps is None else old_per_token_logps.detach()
        ratio = None if vllm_is_ratio is None else vllm_is_ratio.detach()
        need_entropy = self.compute_entropy or return_entropy or opts.entropy_coef != 0.0
        args = (hidden, weight, completion_ids, completion_mask, bias)

        def chunked():
            if return_entropy:
                return RETURNED_ENTROPY
            return single_pass.fgrpo(ref, completion_mask, adv, rw, given_old, ratio, opts)

        out = self._single_pass(*args, chunked, need_entropy)
        if out is None:
            logps, ent = self._logps(*args, need_entropy)
            old = None
            if opts.group_is_weights:
                old = logps.detach() if given_old is None else given_old
            loss = EpilogueFunction.apply(
                logps, epilogue.fgrpo, ent, ref, completion_mask, adv, rw, old, ratio, opts
            )
        else:
            loss, logps, ent = out
        m = metrics.fgrpo(loss, logps, ref, completion_mask, adv, rw, ent, ratio, opts)
        if dp is not None:
            if opts.reduction == Reduction.TOKEN_MEAN:
                loss = self._share(loss, completion_mask.sum(), counts[1], dp[1])
            elif opts.reduction == Reduction.SEQ_MEAN:
                loss = self._share(loss, B, counts[0], dp[1])
            else:
                loss = loss * dp[1]
        return (loss, m, ent) if return_entropy else (loss, m)

    def _global_advantages(self, rewards, dp):
        """This rank's advantages from the whole data-parallel batch's rewards (one O(B)
        all-gather): groups may straddle ranks, and σ over the batch is the batch's."""
        group, world = dp
        opts = self.opts
        every = distributed.gather_rows(rewards.detach().float(), group)
        adv = reference.group_zscore(
            every, opts.num_generations, opts.eps, opts.unbiased, opts.scale
        )
        rank = distributed.dist.get_rank(group)
        return adv[rank * rewards.shape[0] : (rank + 1) * rewards.shape[0]]


class FusedLinearGRPOLoss(_FusedLinearLoss):
    """TRL's GRPOTrainer loss / Liger's LigerFusedLinearGRPOLoss on hidden states (drop-in).

    loss_type "grpo" | "bnpo" | "dr_grpo" | "dapo" | "luspo" | "cispo" | "sapo" | "vespo";
    importance_sampling_level "token" | "sequence" (GSPO; not for cispo, sapo, vespo). old
    log-probs default to the current ones, detached. With beta != 0 the reference log-probs are
    required (`ref_per_token_logps`, or `ref_input`/`ref_hidden`) unless `use_ref_model=False`.
    Keyword `options` (TRL's names, docs/math.md "The GRPO family"): `delta` (two-sided clip),
    `clip_ratio_c` (dual clip), `use_bias_correction_kl`, `entropy_coef` (entropy bonus, with
    its gradient), `top_entropy_quantile` (policy term on high-entropy tokens only),
    `off_policy_mask_threshold` (with `sampling_per_token_logps`, default the old log-probs),
    and `sapo_temperature_pos/neg`, `vespo_k_pos/neg`, `vespo_lambda_pos/neg` (None: TRL's
    defaults); unknown names are a TypeError. Forward takes the rollout engine's IS ratio
    `vllm_is_ratio` [B, T], [B, 1] or [B]; `return_entropy=True` returns (loss, metrics,
    entropy [B, T]) with the entropy differentiable. `compiled` and `chunk_size` are accepted
    for Liger compatibility and have no effect here.
    """

    def __init__(
        self,
        loss_type="dapo",
        beta=0.04,
        epsilon_low=0.2,
        epsilon_high=0.2,
        importance_sampling_level="token",
        temperature=1.0,
        max_completion_length=None,
        use_ref_model=True,
        compute_entropy=False,
        fast_fp32=False,
        compiled=True,
        chunk_size=1,
        *,
        vocab_parallel=None,
        process_group=None,
        max_chunk_bytes=None,
        **options,
    ):
        super().__init__(
            temperature, compute_entropy, fast_fp32, vocab_parallel, process_group, max_chunk_bytes
        )
        self.use_ref_model = bool(use_ref_model)
        self.opts = GRPOOptions.parse(
            loss_type, beta, epsilon_low, epsilon_high, importance_sampling_level,
            max_completion_length, **options,
        )  # fmt: skip

    def entropy_threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The entropy mask's threshold: the (1 − top_entropy_quantile) quantile of the batch's
        unmasked entropies (every rank's with a process_group, as TRL gathers them). Override to
        take it over more than that."""
        dp = self._data_parallel()
        if dp is None:
            return grpo_math.entropy_threshold(entropy, mask, self.opts.top_entropy_quantile)
        values = distributed.gather_values(entropy.detach()[mask.bool()].float(), dp[0])
        every = torch.ones_like(values, dtype=torch.bool)
        return grpo_math.entropy_threshold(values, every, self.opts.top_entropy_quantile)

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        advantages,
        bias=None,
        *,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
        sampling_per_token_logps=None,
        return_entropy=False,
    ):
        opts = self.opts
        B, T, weight, bias = self._batch(hidden, weight, completion_ids, completion_mask, bias)
        check.tensor("advantages", advantages, shape=(B,), floating=True)
        check.optional_per_token("old_per_token_logps", old_per_token_logps, B, T)
        check.optional_per_token("sampling_per_token_logps", sampling_per_token_logps, B, T)
        check.is_ratio("vllm_is_ratio", vllm_is_ratio, B, T)
        check.num_items_in_batch(num_items_in_batch)
        ref = None
        if opts.beta != 0.0 and self.use_ref_model:
            ref = self._given_or_computed(
                "ref_per_token_logps",
                ref_per_token_logps,
                ref_hidden if ref_hidden is not None else ref_input,
                weight if ref_weight is None else ref_weight,
                ref_bias,
                completion_ids,
                completion_mask,
                B,
                T,
            )
            if ref is None:
                raise ValueError(
                    "ref_per_token_logps: expected [B, T] reference log-probs (or "
                    "ref_input) when beta != 0; got None"
                )
        old = None if old_per_token_logps is None else old_per_token_logps.detach()
        sampling = None if sampling_per_token_logps is None else sampling_per_token_logps.detach()
        ratio = None if vllm_is_ratio is None else vllm_is_ratio.detach()
        adv = advantages.detach().float()
        need_entropy = self.compute_entropy or return_entropy or opts.needs_entropy
        dp = self._data_parallel()

        def norms_of(detached, threshold):
            counts = {}
            if dp is not None:  # the whole data-parallel batch's B, Σ mask and bonus tokens
                bonus = 0.0
                if opts.entropy_coef != 0.0:
                    bonus = grpo_math.bonus_mask(completion_mask, opts, detached, threshold).sum()
                total = distributed.global_sum(
                    [B, float(completion_mask.sum()), float(bonus)], dp[0]
                )
                counts = {"batch": int(total[0]), "tokens": float(total[1])}
                if opts.entropy_coef != 0.0:
                    counts["bonus_count"] = float(total[2])
            return grpo_math.normalisers(
                completion_mask, opts, num_items_in_batch, detached, threshold, **counts
            )

        # Without the entropy mask the normalisers need no entropy: one set (and, data-parallel,
        # one collective) whichever path runs on this rank.
        norms = None if opts.entropy_mask else norms_of(None, None)
        args = (hidden, weight, completion_ids, completion_mask, bias)

        def chunked():
            if return_entropy:
                return RETURNED_ENTROPY
            if opts.entropy_mask:
                return ENTROPY_MASK
            return single_pass.grpo(old, ref, completion_mask, adv, ratio, sampling, norms, opts)

        out = self._single_pass(*args, chunked, need_entropy)
        if out is None:
            logps, ent = self._logps(*args, need_entropy)
            if opts.entropy_mask:  # its threshold is a quantile of the batch's entropies
                norms = norms_of(ent.detach(), self.entropy_threshold(ent, completion_mask))
            loss = EpilogueFunction.apply(
                logps, epilogue.grpo, ent, old, ref, completion_mask, adv, ratio, sampling, norms,
                opts,
            )  # fmt: skip
        else:
            loss, logps, ent = out
        m = metrics.grpo(loss, logps, ent, old, ref, completion_mask, adv, ratio, norms, opts)
        if dp is not None:
            loss = loss * dp[1]
        return (loss, m, ent) if return_entropy else (loss, m)


class FusedLinearGIFTLoss(_FusedLinearLoss):
    """GIFT on hidden states: mean_i (R̂_i − β·k̂_i)², k_i the summed log-ratio of row i.

    detach_stats=False differentiates through the group mean/std of k (the paper); True holds
    them constant (the released code). Pass old log-probs as `ref_per_token_logps` for the
    released code's π_old variant.
    """

    def __init__(
        self,
        num_generations,
        beta=1.0,
        eps=1e-4,
        detach_stats=False,
        temperature=1.0,
        unbiased=True,
        compute_entropy=False,
        fast_fp32=False,
        *,
        vocab_parallel=None,
        process_group=None,
        max_chunk_bytes=None,
    ):
        super().__init__(
            temperature, compute_entropy, fast_fp32, vocab_parallel, process_group, max_chunk_bytes
        )
        self.opts = GIFTOptions.parse(num_generations, beta, eps, unbiased, detach_stats)

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        rewards,
        ref_per_token_logps=None,
        *,
        bias=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
    ):
        opts = self.opts
        B, T, weight, bias = self._batch(hidden, weight, completion_ids, completion_mask, bias)
        check.tensor("rewards", rewards, shape=(B,), floating=True)
        check.num_generations("num_generations", opts.num_generations, B)
        ref = self._given_or_computed(
            "ref_per_token_logps",
            ref_per_token_logps,
            ref_hidden,
            weight if ref_weight is None else ref_weight,
            ref_bias,
            completion_ids,
            completion_mask,
            B,
            T,
        )
        if ref is None:
            raise ValueError(
                "ref_per_token_logps: expected [B, T] reference log-probs (or ref_hidden); got None"
            )
        rw = rewards.detach().float()
        args = (hidden, weight, completion_ids, completion_mask, bias)
        out = self._single_pass(
            *args, lambda: single_pass.gift(ref, completion_mask, rw, opts), self.compute_entropy
        )
        if out is None:
            logps, ent = self._logps(*args, self.compute_entropy)
            loss = EpilogueFunction.apply(logps, epilogue.gift, ref, completion_mask, rw, opts)
        else:
            loss, logps, ent = out
        m = metrics.gift(loss, logps, ref, completion_mask, ent, opts)
        dp = self._data_parallel()
        if dp is not None:  # whole groups on every rank: a mean over the batch's rows
            loss = self._share(loss, B, distributed.global_sum([B], dp[0])[0], dp[1])
        return loss, m
