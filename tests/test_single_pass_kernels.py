"""The single pass's chunk primitives (`logits_fwd` / `logits_bwd`) of every backend against a
float64 oracle, over several chunks on awkward shapes; the chunk plan; C++ determinism and the
ops' own argument checks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fgrpo_kernels import reference as R
from fgrpo_kernels.backends import triton as kernels
from fgrpo_kernels.backends.cpu import chunked, cpp
from fgrpo_kernels.core.options import LogProbOptions
from fgrpo_kernels.losses.single_pass import Locality, plan_chunks, plan_pieces
from fgrpo_kernels.testing import rel_error

BACKENDS = {"cpp": cpp, "chunked": chunked, "triton": kernels}
TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def backend_module(name):
    if name == "cpp" and not cpp.available():
        pytest.skip(f"C++ backend not built: {cpp.build_error()}")
    return BACKENDS[name]


def inputs(seed, N, H, V, dtype, bias, tau, ignored):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype)
    w = (2 * torch.randn(V, H, generator=gen, dtype=torch.float64) / H**0.5).to(dtype)
    b = torch.randn(V, generator=gen, dtype=torch.float64) if bias else None
    if b is not None:
        b[torch.rand(V, generator=gen) < 0.1] = float("-inf")  # banned tokens
        b[0] = 0.0
        b = b.to(dtype)
    y = torch.randint(0, V, (N,), generator=gen)
    y[torch.rand(N, generator=gen) < ignored] = -100
    g = torch.randn(N, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(N, generator=gen, dtype=torch.float64)
    return h, w, b, y, g, g_ent, LogProbOptions(tau, -100)


def single_pass(mod, h, w, b, y, g, g_ent, opts, rows, with_entropy, needs):
    """(logp, entropy, dh, dw, db) over chunks of `rows` rows, as the driver walks them."""
    N, V = h.shape[0], w.shape[0]
    acc = torch.promote_types(h.dtype, torch.float32)
    buf = mod.logits_buffer(min(rows, N), V, h)
    logp, ent = torch.zeros(N, dtype=acc), torch.zeros(N, dtype=acc)
    dh = torch.zeros(N, h.shape[1], dtype=acc) if needs[0] else None
    dw = torch.full(w.shape, 7.0, dtype=acc) if needs[1] else None  # overwritten by chunk 0
    db = torch.full((V,), 7.0, dtype=acc) if needs[2] and b is not None else None
    for k, n0 in enumerate(range(0, N, rows)):
        n1 = min(n0 + rows, N)
        part = mod.logits_fwd(h[n0:n1], w, y[n0:n1], b, opts, with_entropy, buf[: n1 - n0])
        logp[n0:n1] = part[0]
        if with_entropy:
            ent[n0:n1] = part[2]
        ge = g_ent[n0:n1].to(acc) if with_entropy else None
        mod.logits_bwd(buf[: n1 - n0], h[n0:n1], w, y[n0:n1], b, part[1], part[2],
                       g[n0:n1].to(acc), ge, opts, None if dh is None else dh[n0:n1], dw, db,
                       k > 0)  # fmt: skip
    return logp, ent, dh, dw, db


def oracle(h, w, b, y, g, g_ent, opts, with_entropy):
    """float64 (logp, entropy, dh, dw, db) of Σ g·logp + Σ g_H·H through the materialised
    logits; inputs upcast as they are (bf16 values exactly)."""
    leaves = [t.double().requires_grad_(True) for t in (h, w)]
    bias = None if b is None else b.double().requires_grad_(True)
    logp, ent = R.logprobs(leaves[0], leaves[1], y, bias, opts.temperature, -100, True)
    loss = (g * logp).sum() + ((g_ent * ent).sum() if with_entropy else 0.0)
    grads = torch.autograd.grad(loss, leaves + ([] if bias is None else [bias]))
    return logp, ent, *grads, *([None] if bias is None else [])


def compare(name, dtype, seed, N, H, V, bias, tau, ignored, rows, with_entropy,
            needs=(True, True, True)):  # fmt: skip
    mod = backend_module(name)
    if name == "triton" and dtype == torch.float64:
        dtype = torch.float32  # the Triton path takes fp32/bf16/fp16
    args = inputs(seed, N, H, V, dtype, bias, tau, ignored)
    got = single_pass(mod, *args, rows, with_entropy, needs)
    want = oracle(*args, with_entropy)
    tol = TOL[dtype]
    for label, a, e in zip(("logp", "entropy", "dh", "dw", "db"), got, want):
        if a is None or (label == "entropy" and not with_entropy):
            continue
        # logp of a banned target is −inf on both sides; compare the finite ones
        finite = torch.isfinite(e)
        assert torch.equal(finite, torch.isfinite(a)), f"{name} {label}: non-finite entries"
        # near 0 an output carries fp32's absolute error (the logp of a p ≈ 1 token): norms
        # floored at 0.1 per element, as in test_cpp_backend
        err = rel_error(a[finite], e[finite], max(0.1 * int(finite.sum()) ** 0.5, 1e-12))
        assert err <= tol, f"{name} {dtype} {label}: {err}"


@pytest.mark.parametrize("name", BACKENDS)
@given(
    seed=st.integers(0, 2**31 - 1),
    N=st.integers(1, 23),
    H=st.integers(1, 40),
    V=st.integers(2, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    bias=st.booleans(),
    tau=st.sampled_from([1.0, 0.6, 1.7]),
    ignored=st.sampled_from([0.0, 0.3, 1.0]),
    rows=st.integers(1, 9),
    with_entropy=st.booleans(),
)
def test_chunks_match_float64(name, seed, N, H, V, dtype, bias, tau, ignored, rows,
                              with_entropy):  # fmt: skip
    compare(name, dtype, seed, N, H, V, bias, tau, ignored, rows, with_entropy)


@pytest.mark.parametrize(
    "name, N, H, V, dtype, rows",
    [
        ("cpp", 300, 17, 8200, torch.float32, 257),  # two token blocks, two vocab splits
        ("cpp", 5, 9, 1025, torch.bfloat16, 5),  # one vocab tile plus one column
        ("cpp", 3, 4, 513, torch.float64, 2),  # fp64 goes to the chunked path
        ("chunked", 7, 5, 4097, torch.float32, 3),  # two vocab chunks
        ("triton", 9, 33, 130, torch.float16, 4),  # fp16: the power-of-two dlogits scale
    ],
)
def test_named_shapes(name, N, H, V, dtype, rows):
    compare(name, dtype, N + V, N, H, V, True, 0.8, 0.2, rows, True)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, False, True)])
def test_frozen_inputs(name, needs):
    compare(name, torch.float32, 5, 11, 7, 90, True, 1.0, 0.1, 4, False, needs)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("M", [0, 6])
def test_fold_adds_an_open_rows_dw_and_db(name, accumulate, M):
    """`fold` (an open row's dW, db and r at its last piece): dw, db take the chunk's terms and
    r times the open row's, overwritten or added to as `accumulate` says, in every backend
    (the C++ one in its vocab sweeps: V of three sweeps and a part)."""
    mod = backend_module(name)
    h, w, b, y, g, _, opts = inputs(M + 3, M, 7, 1700, torch.float32, True, 0.8, 0.2)
    V, H = w.shape
    gen = torch.Generator().manual_seed(11)
    src_w, src_b = torch.randn(V, H, generator=gen), torch.randn(V, generator=gen)
    start_w, start_b = torch.randn(V, H, generator=gen), torch.randn(V, generator=gen)
    r = -0.37

    def bwd(fold):
        buf = mod.logits_buffer(max(M, 1), V, h)[:M]
        _, lse, _ = mod.logits_fwd(h, w, y, b, opts, False, buf)
        dh, dw, db = torch.empty(M, H), start_w.clone(), start_b.clone()
        mod.logits_bwd(buf, h, w, y, b, lse, None, g.float(), None, opts, dh, dw, db, accumulate,
                       fold=fold)  # fmt: skip
        return dh, dw, db

    plain, folded = bwd(None), bwd((src_w, src_b, r))
    assert torch.equal(plain[0], folded[0])
    pairs = (("dw", plain[1], folded[1], src_w), ("db", plain[2], folded[2], src_b))
    for label, p, f, src in pairs:
        want = p.double() + r * src.double()
        assert rel_error(f, want, 0.1 * want.numel() ** 0.5) <= 1e-6, label


def _cpp_outputs(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return single_pass(cpp, *inputs(4, 300, 40, 9000, torch.float32, True, 0.9, 0.1), 270,
                           True, (True, True, True))  # fmt: skip
    finally:
        torch.set_num_threads(previous)


def test_cpp_chunks_are_bitwise_deterministic_across_thread_counts():
    backend_module("cpp")
    one = _cpp_outputs(1)
    for threads in (2, 3):
        for label, a, b in zip(("logp", "entropy", "dh", "dw", "db"), one, _cpp_outputs(threads)):
            assert torch.equal(a, b), f"{label}: 1 vs {threads} threads differ"


def test_cpp_ops_check_their_buffers():
    backend_module("cpp")
    h, w, b, y, g, _, opts = inputs(0, 4, 3, 20, torch.float32, True, 1.0, 0.0)
    good = cpp.logits_buffer(4, 20, h)
    with pytest.raises(ValueError, match="^logits: expected shape"):
        torch.ops.fgrpo.logits_fwd(h, w, y, b, 1.0, -100, False, torch.empty(4, 20))
    with pytest.raises(TypeError, match="^logits: expected a contiguous fp32"):
        torch.ops.fgrpo.logits_fwd(h, w, y, b, 1.0, -100, False, good.double())
    _, lse, _ = cpp.logits_fwd(h, w, y, b, opts, False, good)
    with pytest.raises(ValueError, match="^dw: expected shape"):
        torch.ops.fgrpo.logits_bwd(good, h, w, y, b, lse, None, g.float(), None, 1.0, -100, None,
                                   torch.empty(3, 20), None, False)  # fmt: skip
    with pytest.raises(ValueError, match="^fold_w: given without dw"):
        torch.ops.fgrpo.logits_bwd(good, h, w, y, b, lse, None, g.float(), None, 1.0, -100, None,
                                   None, None, False, torch.zeros(20, 3))  # fmt: skip
    with pytest.raises(ValueError, match="^fold_w: expected shape"):
        torch.ops.fgrpo.logits_bwd(good, h, w, y, b, lse, None, g.float(), None, 1.0, -100, None,
                                   torch.zeros(20, 3), None, False, torch.zeros(3, 20))  # fmt: skip
    with pytest.raises(ValueError, match="^targets: expected ids"):
        torch.ops.fgrpo.logits_fwd(h, w, y + 20, b, 1.0, -100, False, good)


# ----------------------------------------------------------------------------- the chunk plan


@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    locality=st.sampled_from(list(Locality)),
    G=st.sampled_from([1, 2, 3]),
    max_rows=st.integers(1, 20),
)
def test_plan_chunks_cover_the_tokens_and_split_no_unit(lengths, locality, G, max_rows):
    lengths = lengths + [0] * (-len(lengths) % G)
    plan = plan_chunks(lengths, locality, G, max_rows)
    per = {Locality.TOKEN: None, Locality.BATCH: None, Locality.ROW: 1, Locality.GROUP: G}[locality]
    units = [] if per is None else [sum(lengths[i : i + per]) for i in range(0, len(lengths), per)]
    if units and max(units) > max_rows:
        assert isinstance(plan, str) and f"more than a chunk of {max_rows} rows" in plan
        return
    N = sum(lengths)
    assert [n0 for n0, _ in plan] == [0, *(n1 for _, n1 in plan)][: len(plan)]  # contiguous
    assert (plan[-1][1] if plan else 0) == N
    assert all(0 < n1 - n0 <= max_rows for n0, n1 in plan)
    bounds = {0}
    for size in units:
        bounds.add(max(bounds) + size)
    if per is not None:
        assert all(n1 in bounds for _, n1 in plan), (plan, bounds)


@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=12), max_rows=st.integers(1, 12))
def test_plan_pieces_split_only_the_long_rows(lengths, max_rows):
    """Contiguous chunks of at most max_rows tokens; a row that fits lies in one chunk of whole
    rows; a longer row is cut into ⌈L/max_rows⌉ pieces of its own, balanced to one token."""
    chunks, pieces = plan_pieces(lengths, max_rows)
    assert len(chunks) == len(pieces)
    assert [n0 for n0, _ in chunks] == [0, *(n1 for _, n1 in chunks)][: len(chunks)]
    assert (chunks[-1][1] if chunks else 0) == sum(lengths)
    assert all(0 < n1 - n0 <= max_rows for n0, n1 in chunks)
    start = 0
    for size in lengths:
        row = (start, start + size)
        mine = [k for k, (n0, n1) in enumerate(chunks) if n0 < row[1] and n1 > row[0]]
        if size > max_rows:
            assert [pieces[k] for k in mine] == [row] * -(-size // max_rows)
            sizes = [chunks[k][1] - chunks[k][0] for k in mine]
            assert sum(sizes) == size and max(sizes) - min(sizes) <= 1
        elif size:
            assert len(mine) == 1 and pieces[mine[0]] is None
        start += size
