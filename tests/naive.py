"""An independent, loop-by-loop float64 reading of docs/math.md §2–§4 (Python floats and
`math` only).

Written apart from fgrpo_kernels.reference, to catch a misreading of the maths in either.
"""

import math

LN2 = math.log(2.0)


def _e(x):
    return math.exp(min(x, 80.0))


def _softplus(x):
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


# The six shipped divergences, typed again from docs/math.md §3. A divergence added to the table
# later is read from the table itself (`_phi`): its formulas are held to f and f* by
# tests/test_divergences.py, and what this module re-derives independently is the loss structure.
PHI = {
    "kl": (lambda r: -r, lambda r: _e(r - 1.0)),
    "reverse_kl": (lambda r: _e(-r), lambda r: r - 1.0),
    "pearson": (lambda r: -r, lambda r: r + r * r / 4.0 if r >= -2.0 else -1.0),
    "hellinger": (lambda r: math.expm1(min(-r, 80.0)), lambda r: math.expm1(min(r, 80.0))),
    "js": (lambda r: _softplus(-r) - LN2, lambda r: _softplus(r) - LN2),
    "tv": (lambda r: -0.5 * math.tanh(r), lambda r: 0.5 * math.tanh(r)),
}


def _phi(div):
    if div in PHI:
        return PHI[div]
    import torch

    from fgrpo_kernels.divergences import TABLE, get_divergence

    spec = TABLE[get_divergence(div)]

    def lift(fn):
        return lambda r: float(fn(torch.tensor(r, dtype=torch.float64)))

    return lift(spec.phi_pos), lift(spec.phi_neg)


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs, unbiased):
    n = len(xs)
    if n == 1:
        return 0.0
    mu = _mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1 if unbiased else n))


def group_normalize(R, G, eps=1e-4, unbiased=True, scale="group"):
    out = []
    sigma_all = _std(R, unbiased)
    for g0 in range(0, len(R), G):
        grp = R[g0 : g0 + G]
        mu = _mean(grp)
        for x in grp:
            if scale == "group":
                out.append((x - mu) / (_std(grp, unbiased) + eps))
            elif scale == "batch":
                out.append((x - mu) / (sigma_all + eps))
            else:
                out.append(x - mu)
    return out


def _rows(lp, ref, mask):
    return [sum(m * (a - b) for a, b, m in zip(ra, rb, rm)) for ra, rb, rm in zip(lp, ref, mask)]


def is_weights(R, A, old, mask, G):
    S = [sum(m * o for o, m in zip(ro, rm)) for ro, rm in zip(old, mask)]
    w = []
    for i in range(len(R)):
        g0 = (i // G) * G
        s = 1.0 if A[i] > 0 else -1.0
        logits = [s * R[j] - S[j] for j in range(g0, g0 + G)]
        mx = max(logits)
        z = sum(math.exp(x - mx) for x in logits)
        w.append(G * math.exp(logits[i - g0] - mx) / z)
    return w


def fgrpo(lp, ref, A, mask, div, beta, level, reduction, weights=None, rho=None, entropy=None,
          entropy_coef=0.0):  # fmt: skip
    """f-GRPO; rho per token [B][T] or per row [B][1] weights each unit; entropy_coef c
    subtracts c·(masked mean entropy)."""
    loss = _fgrpo(lp, ref, A, mask, div, beta, level, reduction, weights, rho)
    if entropy_coef:
        n = sum(map(sum, mask))
        h = sum(e * m for er, mr in zip(entropy, mask) for e, m in zip(er, mr))
        loss -= entropy_coef * h / max(n, 1)
    return loss


def _fgrpo(lp, ref, A, mask, div, beta, level, reduction, weights, rho):
    pos, neg = _phi(div)
    B = len(lp)
    weights = weights or [1.0] * B
    if rho is not None and len(rho[0]) == 1:
        weights = [w * r[0] for w, r in zip(weights, rho)]
        rho = None
    if level == "sequence":
        units = []
        for i, k in enumerate(_rows(lp, ref, mask)):
            f = pos if A[i] > 0 else neg
            units.append(abs(A[i]) * weights[i] * f(beta * k))
        return _mean(units) if reduction == "seq_mean" else sum(units)
    total, count, per_seq = 0.0, 0.0, []
    for i in range(B):
        f = pos if A[i] > 0 else neg
        row = [
            m * abs(A[i]) * weights[i] * f(beta * (a - b)) * (rho[i][t] if rho else 1.0)
            if m
            else 0.0
            for t, (a, b, m) in enumerate(zip(lp[i], ref[i], mask[i]))
        ]
        total += sum(row)
        count += sum(mask[i])
        per_seq.append(sum(row) / max(sum(mask[i]), 1))
    if reduction == "token_mean":
        return total / max(count, 1)
    if reduction == "seq_mean":
        return _mean(per_seq)
    return total


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def quantile(xs, q):
    """Linear-interpolation quantile (numpy's and torch's default)."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def vespo_phi(lp, old, A, mask, rho, k_pos, lam_pos, k_neg, lam_neg):
    """VESPO's gamma weight per row: log w = Σ_t m·clamp(lp − old, ±20) + Σ_t clamp(log ρ_t)
    (every column of ρ), clamped to [ln 1e-8, 20]; φ = exp(λ + k log w − λ w), non-finite → 0."""
    lo = math.log(1e-8)
    out = []
    for i in range(len(lp)):
        s = sum(m * min(max(a - o, -20.0), 20.0) for a, o, m in zip(lp[i], old[i], mask[i]))
        if rho is not None:
            s += sum(min(max(math.log(r) if r > 0 else -math.inf, lo), 20.0) for r in rho[i])
        log_w = min(max(s, lo), 20.0)
        k, lam = (k_pos, lam_pos) if A[i] >= 0 else (k_neg, lam_neg)
        lam = max(lam, 1e-4)
        try:
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        except OverflowError:
            phi = 0.0
        out.append(phi if math.isfinite(phi) else 0.0)
    return out


def _policy(loss_type, lp, w, a, el, eh, delta, clip_c, sapo, phi):
    """One token's policy term (TRL's per-token loss before weights and KL)."""
    if loss_type == "cispo":
        return -min(w, eh) * a * lp
    if loss_type == "sapo":
        tau = sapo[0] if a > 0 else sapo[1]
        return -a * 4.0 / tau * _sigmoid(tau * (w - 1.0))
    if loss_type == "vespo":
        return -phi * a * lp
    u = w if delta is None else min(w, delta)
    c = min(max(w, 1 - el), 1 + eh)
    pt = -min(u * a, c * a)
    if clip_c is not None and a < 0:
        pt = min(pt, -a * clip_c)
    return pt


def grpo(lp, old, ref, A, mask, loss_type, beta, el, eh, level, max_len=None, n_items=None, *,
         delta=None, clip_c=None, bias_kl=False, rho=None, entropy=None, entropy_coef=0.0,
         top_q=1.0, off_policy=None, sampling=None, sapo=(1.0, 1.05),
         vespo=(2.0, 3.0, 3.0, 2.0)):  # fmt: skip
    """TRL 1.16's GRPO family, loop by loop. rho: per-token [B][T] or per-row [B][1]."""
    B, T = len(lp), len(lp[0])
    old = old or lp
    ref = ref or lp
    per_row_rho = rho is not None and len(rho[0]) == 1
    thr = None
    if top_q < 1.0:
        live = [entropy[i][t] for i in range(B) for t in range(T) if mask[i][t]]
        thr = quantile(live, 1.0 - top_q) if live else math.inf
    phis = vespo_phi(lp, old, A, mask, rho, *vespo) if loss_type == "vespo" else [1.0] * B
    keep = [1.0] * B
    if off_policy is not None:
        samp = sampling or old
        for i in range(B):
            L = sum(mask[i])
            kl = sum(m * (s - a) for s, a, m in zip(samp[i], lp[i], mask[i])) / max(L, 1)
            keep[i] = 1.0 if (A[i] >= 0 or kl <= off_policy) else 0.0
    pts, eff = [], []
    for i in range(B):
        L = sum(mask[i])
        seq_lr = sum(m * (a - o) for a, o, m in zip(lp[i], old[i], mask[i])) / max(L, 1)
        row, erow = [], []
        for t in range(T):
            lr = seq_lr if level == "sequence" else (lp[i][t] - old[i][t]) * mask[i][t]
            w = _e(lr)
            pt = _policy(loss_type, lp[i][t], w, A[i], el, eh, delta, clip_c, sapo, phis[i])
            e = 1.0
            if thr is not None:
                e = 1.0 if (mask[i][t] and entropy[i][t] * mask[i][t] >= thr) else 0.0
            pt *= keep[i] * e
            if rho is not None and loss_type != "vespo":
                pt *= rho[i][0] if per_row_rho else rho[i][t]
            if beta != 0:
                d = (ref[i][t] - lp[i][t]) * mask[i][t]
                pt += beta * (_e(d) - d - 1) * (w if bias_kl else 1.0)
            row.append(pt * mask[i][t])
            erow.append(e * mask[i][t])
        pts.append(row)
        eff.append(erow)
    total = sum(map(sum, pts))
    n_tok = sum(map(sum, mask))
    if loss_type in ("grpo", "sapo"):
        loss = _mean([sum(r) / max(sum(m), 1) for r, m in zip(pts, mask)])
    elif loss_type == "bnpo":
        loss = total / max(n_tok, 1)
    elif loss_type == "dr_grpo":
        loss = total / (B * (max_len or T))
    elif loss_type == "luspo":
        loss = total / B
    else:
        loss = total / max(n_items if n_items is not None else n_tok, 1)
    if entropy_coef:
        n_eff = sum(map(sum, eff))
        h = sum(entropy[i][t] * eff[i][t] for i in range(B) for t in range(T))
        loss -= entropy_coef * h / max(n_eff, 1)
    return loss


def gift(lp, ref, R, mask, G, beta=1.0, eps=1e-4, unbiased=True):
    k = _rows(lp, ref, mask)
    kh = group_normalize(k, G, eps, unbiased)
    rh = group_normalize(R, G, eps, unbiased)
    return _mean([(a - beta * b) ** 2 for a, b in zip(rh, kh)])


def fdo(lp, ref, mask, chosen, div, beta):
    pos, neg = _phi(div)
    r = [beta * k for k in _rows(lp, ref, mask)]
    return _mean([pos(x) for x, c in zip(r, chosen) if c]) + _mean(
        [neg(x) for x, c in zip(r, chosen) if not c]
    )
