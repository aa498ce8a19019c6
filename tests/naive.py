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


def fgrpo(lp, ref, A, mask, div, beta, level, reduction, weights=None):
    pos, neg = _phi(div)
    B = len(lp)
    weights = weights or [1.0] * B
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
            m * abs(A[i]) * weights[i] * f(beta * (a - b)) if m else 0.0
            for a, b, m in zip(lp[i], ref[i], mask[i])
        ]
        total += sum(row)
        count += sum(mask[i])
        per_seq.append(sum(row) / max(sum(mask[i]), 1))
    if reduction == "token_mean":
        return total / max(count, 1)
    if reduction == "seq_mean":
        return _mean(per_seq)
    return total


def grpo(lp, old, ref, A, mask, loss_type, beta, el, eh, level, max_len=None, n_items=None):
    B, T = len(lp), len(lp[0])
    old = old or lp
    ref = ref or lp
    pts = []
    for i in range(B):
        L = sum(mask[i])
        seq_lr = sum(m * (a - o) for a, o, m in zip(lp[i], old[i], mask[i])) / max(L, 1)
        row = []
        for t in range(T):
            lr = seq_lr if level == "sequence" else (lp[i][t] - old[i][t]) * mask[i][t]
            c1 = _e(lr)
            c2 = min(max(c1, 1 - el), 1 + eh)
            pt = -min(c1 * A[i], c2 * A[i])
            if beta != 0:
                d = (ref[i][t] - lp[i][t]) * mask[i][t]
                pt += beta * (_e(d) - d - 1)
            row.append(pt * mask[i][t])
        pts.append(row)
    total = sum(map(sum, pts))
    n_tok = sum(map(sum, mask))
    if loss_type == "grpo":
        return _mean([sum(r) / max(sum(m), 1) for r, m in zip(pts, mask)])
    if loss_type == "bnpo":
        return total / max(n_tok, 1)
    if loss_type == "dr_grpo":
        return total / (B * (max_len or T))
    return total / max(n_items if n_items is not None else n_tok, 1)


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
