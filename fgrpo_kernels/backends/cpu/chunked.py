"""Chunked-PyTorch CPU backend of the fused linear log-prob (the fallback of the C++ one).

Tiles of TOKEN_CHUNK tokens × VOCAB_CHUNK vocab entries, products in fp32. Forward keeps an
online log-sum-exp per row; backward recomputes each logits tile from the saved LSE. Extra
memory: one tile, plus the fp32 accumulators of the gradients. Same signatures as the Triton
launchers `logprob_fwd` / `logprob_bwd`.

Entropy is accumulated relative to the running max m: s = Σ e^(z−m), t = Σ e^(z−m)(z−m), so
H = log s − t/s without cancelling two large numbers when the logits are large.
"""

from __future__ import annotations

import torch

from ...core.options import LogProbOptions
from .. import distributed, fold_into

TOKEN_CHUNK = 1024
VOCAB_CHUNK = 4096


def acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """fp32 products for fp32/bf16/fp16 inputs; fp64 inputs stay fp64."""
    return torch.promote_types(hidden.dtype, torch.float32)


def bytes_per_row(hidden: torch.Tensor, V: int) -> int:
    """Bytes per row of the single pass's logits buffer (one `acc_dtype` logit per entry)."""
    return V * acc_dtype(hidden).itemsize


def logits_buffer(rows: int, V: int, hidden: torch.Tensor) -> torch.Tensor:
    """The single pass's logits buffer for `rows` rows (uninitialised)."""
    return torch.empty(rows, V, dtype=acc_dtype(hidden))


def unsupported(hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why a single pass cannot run here: never (every dtype mix is converted per tile)."""
    return None


def _logits_tile(h, weight, bias, v0, v1, inv_t):
    z = h @ weight[v0:v1].to(h.dtype).T
    if bias is not None:
        z += bias[v0:v1].to(h.dtype)
    return z.mul_(inv_t)


class _RowLSE:
    """The online log-sum-exp of a block of rows over its vocab tiles: running max m,
    s = Σ e^(z−m), t = Σ e^(z−m)(z−m) (entropy) and the target's logit z_y."""

    def __init__(self, targets, opts: LogProbOptions, acc: torch.dtype):
        rows = targets.shape[0]
        self.y, self.valid = targets, targets != opts.ignore_index
        self.m = torch.full((rows,), -torch.inf, dtype=acc)
        self.s = torch.zeros(rows, dtype=acc)
        self.t = torch.zeros(rows, dtype=acc)
        self.z_y = torch.zeros(rows, dtype=acc)

    def fold(self, z: torch.Tensor, v0: int) -> None:
        """Folds the tile z [rows, v1 − v0] of vocab entries [v0, v1) into the state."""
        m, s = self.m, self.s
        m_new = torch.maximum(m, z.amax(-1))
        # NB: banned tokens (−inf logits) have p = 0 and add nothing: a tile of them leaves m at
        # −inf (shift by 0 instead of −inf − (−inf)), and e·u is 0 where e = 0.
        m_ref = torch.where(torch.isfinite(m_new), m_new, 0.0)
        scale = torch.exp(m - m_ref)
        u = z - m_ref[:, None]
        e = torch.exp(u)
        shift = torch.where(torch.isfinite(m), m - m_new, 0.0)
        self.t = scale * (self.t + shift * s) + torch.where(e > 0, e * u, 0.0).sum(-1)
        self.s = scale * s + e.sum(-1)
        self.m = m_new
        cols = z.shape[1]
        local = self.y - v0
        hit = self.valid & (local >= 0) & (local < cols)
        picked = z.gather(1, local.clamp(0, cols - 1)[:, None])[:, 0]
        self.z_y += torch.where(hit, picked, 0.0)

    def finish(self, return_entropy: bool):
        """(logp, lse, entropy | None) of the rows (logp and entropy 0 on ignored rows)."""
        lse = self.m + torch.log(self.s)
        logp = torch.where(self.valid, self.z_y - lse, 0.0)
        if not return_entropy:
            return logp, lse, None
        return logp, lse, torch.where(self.valid, torch.log(self.s) - self.t / self.s, 0.0)


def logprob_fwd(hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool):
    """hidden [N, H], weight [V, H], targets [N] → (logp [N], lse [N], entropy [N] | None), fp32
    (fp64 for fp64 inputs)."""
    targets = distributed.local_targets(targets, opts, weight.shape[0])
    N, V = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / opts.temperature
    acc = acc_dtype(hidden)
    logp = torch.empty(N, dtype=acc)
    lse = torch.empty(N, dtype=acc)
    entropy = torch.empty(N, dtype=acc) if return_entropy else None
    for n0 in range(0, N, TOKEN_CHUNK):
        n1 = min(n0 + TOKEN_CHUNK, N)
        h = hidden[n0:n1].to(acc)
        state = _RowLSE(targets[n0:n1], opts, acc)
        for v0 in range(0, V, VOCAB_CHUNK):
            v1 = min(v0 + VOCAB_CHUNK, V)
            state.fold(_logits_tile(h, weight, bias, v0, v1, inv_t), v0)
        out = state.finish(return_entropy)
        logp[n0:n1], lse[n0:n1] = out[0], out[1]
        if entropy is not None:
            entropy[n0:n1] = out[2]
    return logp, lse, entropy


def _dlogits(z, y, valid, g, lse, g_ent, entropy, v0: int, inv_t: float) -> torch.Tensor:
    """dlogits of the tile z [rows, cols] (vocab entries v0 + j) for Σ g·logp + Σ g_H·entropy:
    (g·(onehot − p) − g_H·p·(z − lse + H)) / τ, 0 on ignored rows; at the target column
    g·(1 − p_y) is taken as −g·expm1(z_y − lse)."""
    u = z - lse[:, None]
    p = torch.exp(u)
    dz = p * -g[:, None]
    cols = z.shape[1]
    local = y - v0
    rows = torch.nonzero(valid & (local >= 0) & (local < cols))[:, 0]
    # NB: g·(1 − p_y) as −g·expm1(u_y): a near-certain target keeps its precision.
    dz[rows, local[rows]] = -g[rows] * torch.expm1(u[rows, local[rows]])
    if g_ent is not None:
        # p·(z − lse + H) is 0 where p = 0 (a banned token's u is −inf)
        dz -= g_ent[:, None] * p * torch.where(p > 0, u + entropy[:, None], 0.0)
    return dz.masked_fill_(~valid[:, None], 0.0).mul_(inv_t)


def _row_grads(targets, grad_logp, grad_entropy, opts: LogProbOptions, acc: torch.dtype):
    """(valid, g, g_H | None): the per-row gradients in `acc`, 0 on ignored rows."""
    valid = targets != opts.ignore_index
    zeros = torch.zeros(targets.shape[0], dtype=acc)
    g = zeros if grad_logp is None else torch.where(valid, grad_logp.to(acc), 0.0)
    g_ent = None if grad_entropy is None else torch.where(valid, grad_entropy.to(acc), 0.0)
    return valid, g, g_ent


def logprob_bwd(
    hidden,
    weight,
    targets,
    bias,
    lse,
    entropy,
    grad_logp,
    grad_entropy,
    opts: LogProbOptions,
    needs: tuple[bool, bool, bool],
):
    """Gradients (dhidden, dweight, dbias) of Σ g·logp + Σ g_H·entropy; None where not needed.

    dz = (g·(onehot − p) − g_H·p·(z − lse + H)) / τ per logits tile; at the target column
    g·(1 − p_y) is taken as −g·expm1(z_y − lse).
    """
    targets = distributed.local_targets(targets, opts, weight.shape[0])
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    N, V = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / opts.temperature
    acc = acc_dtype(hidden)
    valid, g, g_ent = _row_grads(targets, grad_logp, grad_entropy, opts, acc)
    dh = torch.zeros(hidden.shape, dtype=acc) if need_h else None
    dw = torch.zeros(weight.shape, dtype=acc) if need_w else None
    db = torch.zeros(V, dtype=acc) if need_b else None
    for n0 in range(0, N, TOKEN_CHUNK):
        n1 = min(n0 + TOKEN_CHUNK, N)
        h = hidden[n0:n1].to(acc)
        ent = None if entropy is None else entropy[n0:n1]
        rows = (targets[n0:n1], valid[n0:n1], g[n0:n1], lse[n0:n1])
        gh = None if g_ent is None else g_ent[n0:n1]
        # NB: ignored rows of dz and of dW's hidden operand are set to 0, not multiplied by 0:
        # a NaN or inf hidden state there must not reach the gradients (NaN·0 = NaN)
        h_w = h.masked_fill(~valid[n0:n1, None], 0.0) if need_w else None
        for v0 in range(0, V, VOCAB_CHUNK):
            v1 = min(v0 + VOCAB_CHUNK, V)
            dz = _dlogits(_logits_tile(h, weight, bias, v0, v1, inv_t), *rows, gh, ent, v0, inv_t)
            if need_h:
                dh[n0:n1] += dz @ weight[v0:v1].to(acc)
            if need_w:
                dw[v0:v1] += dz.T @ h_w
            if need_b:
                db[v0:v1] += dz.sum(0)
    return (
        None if dh is None else dh.to(hidden.dtype),
        None if dw is None else dw.to(weight.dtype),
        None if db is None else db.to(bias.dtype),
    )


def logits_fwd(hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool, logits):
    """One chunk of the single pass: `logprob_fwd` of hidden [M, H] that leaves the chunk's
    logits z = (h W^T + b)/τ in `logits` [M, V] (acc dtype) for `logits_bwd`."""
    V = weight.shape[0]
    inv_t = 1.0 / opts.temperature
    h = hidden.to(logits.dtype)
    state = _RowLSE(targets, opts, logits.dtype)
    for v0 in range(0, V, VOCAB_CHUNK):
        v1 = min(v0 + VOCAB_CHUNK, V)
        z = logits[:, v0:v1]
        z.copy_(_logits_tile(h, weight, bias, v0, v1, inv_t))
        state.fold(z, v0)
    return state.finish(return_entropy)


def logits_bwd(logits, hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
               opts: LogProbOptions, dh, dw, db, accumulate: bool, fold=None):  # fmt: skip
    """The rest of the chunk: `logits` (left by `logits_fwd`) → dlogits of Σ g·logp + Σ g_H·H in
    place; dh [M, H] = dz W, dw [V, H] (+)= dz^T h, db [V] (+)= Σ_n dz (acc dtype; None: not
    wanted; `accumulate` False overwrites dw and db). `fold` (dw_src, db_src, alpha): dw and db
    also take alpha·dw_src, alpha·db_src (an open row's, docs/math.md §5; `fold_into`)."""
    accumulate = fold_into(dw, db, fold, accumulate)
    V = weight.shape[0]
    inv_t = 1.0 / opts.temperature
    acc = logits.dtype
    valid, g, g_ent = _row_grads(targets, grad_logp, grad_entropy, opts, acc)
    h_w = hidden.to(acc).masked_fill(~valid[:, None], 0.0) if dw is not None else None
    for v0 in range(0, V, VOCAB_CHUNK):
        v1 = min(v0 + VOCAB_CHUNK, V)
        z = logits[:, v0:v1]
        z.copy_(_dlogits(z, targets, valid, g, lse, g_ent, entropy, v0, inv_t))
        if dh is not None:
            w = weight[v0:v1].to(acc)
            dh.copy_(z @ w) if v0 == 0 else dh.addmm_(z, w)
        if dw is not None:
            dw[v0:v1].addmm_(z.T, h_w, beta=1.0 if accumulate else 0.0)
        if db is not None:
            db[v0:v1] = db[v0:v1] + z.sum(0) if accumulate else z.sum(0)
