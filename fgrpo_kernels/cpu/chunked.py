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

from .. import distributed
from ..options import LogProbOptions

TOKEN_CHUNK = 1024
VOCAB_CHUNK = 4096


def acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """fp32 products for fp32/bf16/fp16 inputs; fp64 inputs stay fp64."""
    return torch.promote_types(hidden.dtype, torch.float32)


def _logits_tile(h, weight, bias, v0, v1, inv_t):
    z = h @ weight[v0:v1].to(h.dtype).T
    if bias is not None:
        z += bias[v0:v1].to(h.dtype)
    return z.mul_(inv_t)


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
        y = targets[n0:n1]
        valid = y != opts.ignore_index
        m = torch.full((n1 - n0,), -torch.inf, dtype=acc)
        s = torch.zeros(n1 - n0, dtype=acc)
        t = torch.zeros(n1 - n0, dtype=acc)
        z_y = torch.zeros(n1 - n0, dtype=acc)
        for v0 in range(0, V, VOCAB_CHUNK):
            v1 = min(v0 + VOCAB_CHUNK, V)
            z = _logits_tile(h, weight, bias, v0, v1, inv_t)
            m_new = torch.maximum(m, z.amax(-1))
            # NB: banned tokens (−inf logits) have p = 0 and add nothing: a tile of them leaves
            # m at −inf (shift by 0 instead of −inf − (−inf)), and e·u is 0 where e = 0.
            m_ref = torch.where(torch.isfinite(m_new), m_new, 0.0)
            scale = torch.exp(m - m_ref)
            u = z - m_ref[:, None]
            e = torch.exp(u)
            shift = torch.where(torch.isfinite(m), m - m_new, 0.0)
            t = scale * (t + shift * s) + torch.where(e > 0, e * u, 0.0).sum(-1)
            s = scale * s + e.sum(-1)
            m = m_new
            local = y - v0
            hit = valid & (local >= 0) & (local < v1 - v0)
            z_y += torch.where(hit, z.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0], 0.0)
        row_lse = m + torch.log(s)
        lse[n0:n1] = row_lse
        logp[n0:n1] = torch.where(valid, z_y - row_lse, 0.0)
        if entropy is not None:
            entropy[n0:n1] = torch.where(valid, torch.log(s) - t / s, 0.0)
    return logp, lse, entropy


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
    valid = targets != opts.ignore_index
    acc = acc_dtype(hidden)
    g = (
        torch.zeros(N, dtype=acc)
        if grad_logp is None
        else torch.where(valid, grad_logp.to(acc), 0.0)
    )
    g_ent = None if grad_entropy is None else torch.where(valid, grad_entropy.to(acc), 0.0)
    dh = torch.zeros(hidden.shape, dtype=acc) if need_h else None
    dw = torch.zeros(weight.shape, dtype=acc) if need_w else None
    db = torch.zeros(V, dtype=acc) if need_b else None
    for n0 in range(0, N, TOKEN_CHUNK):
        n1 = min(n0 + TOKEN_CHUNK, N)
        h = hidden[n0:n1].to(acc)
        y, gn, row_lse = targets[n0:n1], g[n0:n1], lse[n0:n1, None]
        ignored = ~valid[n0:n1, None]
        # NB: ignored rows of dz and of dW's hidden operand are set to 0, not multiplied by 0:
        # a NaN or inf hidden state there must not reach the gradients (NaN·0 = NaN)
        h_w = h.masked_fill(ignored, 0.0) if need_w else None
        for v0 in range(0, V, VOCAB_CHUNK):
            v1 = min(v0 + VOCAB_CHUNK, V)
            z = _logits_tile(h, weight, bias, v0, v1, inv_t)
            u = z - row_lse
            p = torch.exp(u)
            dz = p * -gn[:, None]
            local = y - v0
            hit = valid[n0:n1] & (local >= 0) & (local < v1 - v0)
            rows = torch.nonzero(hit)[:, 0]
            # NB: g·(1 − p_y) as −g·expm1(u_y): a near-certain target keeps its precision.
            dz[rows, local[rows]] = -gn[rows] * torch.expm1(u[rows, local[rows]])
            if g_ent is not None:
                # p·(z − lse + H) is 0 where p = 0 (a banned token's u is −inf)
                dz -= g_ent[n0:n1, None] * p * torch.where(p > 0, u + entropy[n0:n1, None], 0.0)
            dz.masked_fill_(ignored, 0.0).mul_(inv_t)
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
