"""Shared draws of the policy-variant tests: log-probs in [−4, 0] with 0, −30 and −1e-3 among
them (log-ratios up to ±30), advantages with zeros, and masks whose rows may be empty."""

import torch
from hypothesis import strategies as st

LOGPS = st.one_of(st.sampled_from([0.0, -30.0, -1e-3]), st.floats(-4.0, 0.0))
ADVS = st.one_of(st.just(0.0), st.floats(-2.0, 2.0))


def matrix(draw, B, T, values=LOGPS):
    return torch.tensor(draw(st.lists(values, min_size=B * T, max_size=B * T))).reshape(B, T)


def base_batch(draw):
    """(logp, old, advantages [B], mask) with B in 1..5, T in 1..6."""
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    adv = torch.tensor(draw(st.lists(ADVS, min_size=B, max_size=B)))
    return matrix(draw, B, T), matrix(draw, B, T), adv, mask
