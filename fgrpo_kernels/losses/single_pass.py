"""Single-pass fused losses: the gradients formed in the forward sweep (docs/math.md §5).

The two-pass path computes the log-probs (logits once), runs the loss epilogue, and in backward
recomputes the logits to form dlogits: 8·N·H·V FLOPs. Where dL/dlogp of a chunk of tokens is
known once the chunk's log-probs are, the sweep instead walks the tokens in chunks and, per
chunk, (1) computes the logits into a bounded buffer and their lse, logp, entropy
(`logits_fwd`), (2) runs the epilogue on the chunk for dL/dlogp (and dL/dentropy), (3) turns
the buffer into dlogits in place and forms dh (the chunk's rows) and dW, db (accumulated)
(`logits_bwd`): 6·N·H·V FLOPs. Backward only scales the stored gradients.

A chunk's dL/dlogp needs that chunk alone when the loss is `Locality.TOKEN` (with its batch-wide
normalisers — Σ mask, num_items_in_batch, B, advantages from rewards — computed up front), or
when the chunk holds whole sequences (`ROW`) or whole groups (`GROUP`). Each loss here states its
locality and runs the ordinary epilogue on a chunk (`ChunkedLoss`); the value of the loss is the
epilogue on the whole batch's log-probs, as on the two-pass path. `plan` says why not when the
single pass cannot run (the module then takes the two-pass path).

Shapes: hidden [N, H] (the unmasked tokens, row-major), weight [V, H], targets [N]; per-token
side inputs [B, T], per-sequence [B].
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..backends import memory, phases
from ..core import grpo_math
from ..core import validation as check
from ..core.options import (
    FDOOptions,
    FGRPOOptions,
    GIFTOptions,
    GRPOOptions,
    Level,
    LogProbOptions,
    Reduction,
)
from ..head.autograd import SinglePassFunction, select_backend
from ..head.batch import Batch
from ..head.options import HeadOptions
from . import epilogue

ENV = "FGRPO_MAX_CHUNK_BYTES"
# The logits buffer by default: ~1 GiB on a GPU (a few thousand rows of a 128k vocabulary); on
# the CPU 32 MiB, a few hundred rows of a 32k vocabulary, which the last-level cache mostly holds.
DEFAULT_BYTES = {"cuda": 1 << 30, "cpu": 32 << 20}


# Why a loss takes the two-pass path (docs/math.md §5, "Single pass"): every reason lives here.
NO_GRADIENT = "no gradient is wanted (a forward alone is one pass)"
VOCAB_PARALLEL = "vocab_parallel: a chunk's log-sum-exp needs every rank's shard of the vocabulary"
RETURNED_ENTROPY = (
    "return_entropy=True: the entropy is returned with its gradient, whose upstream is not known "
    "in the forward"
)
ENTROPY_MASK = (
    "top_entropy_quantile < 1: the entropy mask's threshold is a quantile of the whole batch's "
    "entropies"
)


class Locality(enum.IntEnum):
    """What a token's dL/dlogp depends on, beyond numbers computed up front: the token alone,
    its whole sequence, its whole group of G sequences, or the whole batch (kl_cov's top-k,
    M2PO's τ: chunks cut anywhere take a provisional gradient, corrected at the sweep's end on
    the tokens where the true one differs, `_Sweep.correct`)."""

    TOKEN = 0
    ROW = 1
    GROUP = 2
    BATCH = 3


@dataclass(frozen=True)
class ChunkedLoss:
    """A loss as the single pass sees it.

    `grad(rows, mask, logps, entropy)` → (dL/dlogp, dL/dentropy | None), each [b, T], for the
    batch rows `rows` (a slice of b rows) where `mask` marks the chunk's tokens only; `loss(logps,
    entropy)` is the whole batch's value. `group` is G for `Locality.GROUP`. `scaled` (at
    `Locality.ROW`): a row's dL/dlogp and dL/dentropy are one number of the row times numbers of
    each token alone (GSPO, GMPO), so a row longer than a chunk can run as open-row pieces
    (`plan_pieces`; checked at the row's end, `_common_scale`). `token_part(idx, logp)` (read
    only where `scaled` holds): u_t of the tokens at flat positions idx in [B·T] with log-probs
    logp, from each token's own numbers: an open row's earlier pieces take it in place of a
    `grad` call on the row so far (one `grad` call a row, at its end, which checks every u_t)."""

    locality: Locality
    grad: Callable
    loss: Callable
    group: int = 1
    scaled: bool = False
    token_part: Callable | None = None


def chunk_bytes(max_chunk_bytes: int | None, device: torch.device) -> int:
    """The buffer budget: `max_chunk_bytes`, else $FGRPO_MAX_CHUNK_BYTES, else the device's
    default (0: the two-pass path): on CUDA sized from free memory (`backends.memory`)."""
    if max_chunk_bytes is not None:
        return max_chunk_bytes
    env = os.environ.get(ENV)
    if env is not None:
        if not env.isdigit():
            raise ValueError(f"{ENV}: expected a number of bytes >= 0; got {env!r}")
        return int(env)
    if device.type == "cuda":
        return memory.device_chunk_bytes(device)
    return DEFAULT_BYTES["cpu"]


def plan_chunks(lengths: list[int], locality: Locality, group: int, max_rows: int):
    """Token ranges [(n0, n1)] of at most `max_rows` tokens that split no unit (a token, a
    sequence of lengths[i] tokens, or G consecutive sequences), greedily; or a reason (str)
    when a unit is longer than `max_rows`."""
    N = sum(lengths)
    if locality in (Locality.TOKEN, Locality.BATCH):
        return [(n0, min(n0 + max_rows, N)) for n0 in range(0, N, max_rows)]
    per = 1 if locality == Locality.ROW else group
    units = [sum(lengths[i : i + per]) for i in range(0, len(lengths), per)]
    what = "a sequence" if per == 1 else f"a group of {per} sequences"
    if units and max(units) > max_rows:
        return f"{what} holds {max(units)} tokens, more than a chunk of {max_rows} rows"
    return plan_pieces(units, max_rows)[0]


def plan_pieces(units: list[int], max_rows: int):
    """(chunks, pieces): consecutive units (rows, for open rows) of these token counts packed
    greedily into chunks of at most `max_rows` tokens (`plan_chunks` packs whole ones); a unit
    longer than that is cut into ⌈L/max_rows⌉ balanced pieces, one chunk each. pieces[k] is the
    token range (u0, u1) of the unit chunk k is a piece of, or None for a chunk of whole units."""
    chunks, pieces, n0, n1 = [], [], 0, 0
    for size in units:
        if size <= max_rows and n1 + size - n0 <= max_rows:
            n1 += size
            continue
        if n1 > n0:
            chunks.append((n0, n1))
            pieces.append(None)
        n0 = n1
        if size <= max_rows:
            n1 += size
            continue
        k = -(-size // max_rows)
        cuts = [n0 + size * j // k for j in range(k + 1)]
        chunks += list(zip(cuts[:-1], cuts[1:]))
        pieces += [(n0, n0 + size)] * k
        n0 = n1 = n0 + size
    if n1 > n0:
        chunks.append((n0, n1))
        pieces.append(None)
    return chunks, pieces


def _row_span(starts: list[int], n0: int, n1: int, locality: Locality, group: int) -> slice:
    """The batch rows the tokens [n0, n1) lie in (`starts`: each row's first token), widened
    to whole groups at GROUP locality."""
    b0 = bisect.bisect_right(starts, n0) - 1
    b1 = bisect.bisect_right(starts, n1 - 1)
    if locality == Locality.GROUP:
        b0, b1 = b0 - b0 % group, -(-b1 // group) * group
    return slice(b0, b1)


def plan(hidden, weight, lengths: list[int], loss: ChunkedLoss | str, max_bytes: int,
         bias: bool = False):  # fmt: skip
    """(backend, rows per chunk, chunks, pieces) for a single pass, or why it cannot run (str);
    `bias`: the head has one (an open row then keeps its db too)."""
    if isinstance(loss, str):
        return loss
    if max_bytes == 0:
        return "max_chunk_bytes=0"
    backend = select_backend(hidden.device)
    V = weight.shape[0]
    if hasattr(backend, "unsupported"):
        why = backend.unsupported(hidden, weight)
        if why is not None:
            return why
    per_row = backend.bytes_per_row(hidden, V)
    max_rows = max_bytes // per_row
    if max_rows == 0:
        return f"one row of logits ({per_row} bytes) exceeds max_chunk_bytes={max_bytes}"
    chunks = plan_chunks(lengths, loss.locality, loss.group, max_rows)
    if isinstance(chunks, str):
        return _open_rows(backend, hidden, V, bias, lengths, loss, max_bytes, per_row, chunks)
    return backend, max_rows, chunks, None


def _acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """What the sweep forms log-probs and gradients in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(hidden.dtype, torch.float32)


def _open_rows(backend, hidden, V, bias, lengths, loss, max_bytes, per_row, why):
    """The plan of a `scaled` loss whose longest row exceeds a chunk: the open row's dW and,
    with a bias, db (fp32 [V, H] and [V]) take their bytes out of the budget, at most half of
    it; else why not."""
    if not (loss.scaled and loss.locality == Locality.ROW):
        return why
    acc = _acc_dtype(hidden).itemsize
    open_bytes = V * (hidden.shape[-1] + bool(bias)) * acc
    max_rows = (max_bytes - open_bytes) // per_row
    if 2 * open_bytes > max_bytes or max_rows == 0:
        return (f"{why}, and the open row's dW ({open_bytes} bytes) would take more than half "
                f"of max_chunk_bytes={max_bytes}")  # fmt: skip
    return (backend, max_rows, *plan_pieces(lengths, max_rows))


@dataclass(frozen=True)
class Plan:
    """The single pass as it will run: the backend, rows per chunk, the token ranges, the pieces
    of open rows (`plan_pieces`; None: every chunk holds whole units), the loss."""

    backend: object
    max_rows: int
    chunks: list
    pieces: list | None
    loss: ChunkedLoss

    def __str__(self) -> str:
        return "single"


@dataclass(frozen=True)
class Refusal:
    """Why the two-pass path runs instead."""

    reason: str

    def __str__(self) -> str:
        return f"two-pass: {self.reason}"


def decide(batch: Batch, head: HeadOptions, chunked: Callable[[], ChunkedLoss | str]):
    """The path of one call, decided once: a `Plan`, or a `Refusal` with its reason.
    `chunked()` builds the loss's `ChunkedLoss`, or says (str) why it has none; it is called
    only when a single pass could otherwise run."""
    if not batch.wants_grad():
        return Refusal(NO_GRADIENT)
    if head.vocab_parallel is not None:
        return Refusal(VOCAB_PARALLEL)
    max_bytes = chunk_bytes(head.max_chunk_bytes, batch.hidden.device)
    loss = chunked() if max_bytes else None
    how = plan(batch.hidden, batch.weight, batch.lengths(), loss, max_bytes, batch.bias is not None)
    return Refusal(how) if isinstance(how, str) else Plan(*how, loss)


def execute(how: Plan, batch: Batch, head: HeadOptions, entropy: bool):
    """(loss, logps [B, T], entropy [B, T] | None) of the batch by the planned single pass."""
    positions, rows, targets = batch.tokens()
    check.logprob_inputs(rows, batch.weight, targets, batch.bias, head.temperature, -100)
    bias = None if batch.bias is None else batch.bias.contiguous()
    return run(how.backend, how.max_rows, how.chunks, rows, batch.weight.contiguous(), targets,
               bias, head.logprob_options(), positions, batch.mask, how.loss, entropy,
               how.pieces)  # fmt: skip


def run(backend, max_rows, chunks, hidden, weight, targets, bias, lp_opts: LogProbOptions,
        positions, mask, loss: ChunkedLoss, entropy: bool, pieces=None):  # fmt: skip
    """(loss, logps [B, T], entropy [B, T] | None) through `SinglePassFunction`; `positions` are
    the flat indices in [B·T] of the N tokens; `pieces` as `plan_pieces` gives them."""
    B, T = mask.shape

    def sweep(h, w, b, needs):
        s = _Sweep(backend, max_rows, h, w, b, targets, lp_opts, needs, entropy, positions, mask,
                   loss, pieces is not None)  # fmt: skip
        for k, (n0, n1) in enumerate(chunks):
            s.chunk(n0, n1, None if pieces is None else pieces[k])
        if loss.locality == Locality.BATCH:
            s.correct()
        whole = torch.zeros(B * T, dtype=s.acc, device=h.device)
        logps = whole.index_copy(0, positions, s.logp).view(B, T)
        ents = None if s.ent is None else whole.index_copy(0, positions, s.ent).view(B, T)
        value = loss.loss(logps, ents)
        dw = None if s.dw is None else s.dw.to(w.dtype)
        db = None if s.db is None else s.db.to(b.dtype)
        return value, logps, ents, s.dh, dw, db

    value, logps, ents = SinglePassFunction.apply(hidden, weight, bias, sweep)
    return value, logps, ents if entropy else None


class _Sweep:
    """One single pass's state: the logits buffer, the log-probs, the gradients, and, with open
    rows, the open row's dW and db.

    A row longer than a chunk runs in pieces. Each piece but the last takes the loss's
    `token_part` u_t, or without one the provisional dL/dlogp that `loss.grad` gives with the
    row's tokens so far live (the rest absent), which where the earlier tokens' provisional
    gradients are r times those stored for them (`_common_scale`) is divided by r; that goes
    into the open row's dW and db and its dh rows. At the last piece the row's true gradient is
    known: r (true = r·stored on the earlier tokens, `_common_scale`), then dW += r·dW_open,
    db += r·db_open (within that piece's backward, block by block) and the earlier dh rows times
    r (for GSPO and GMPO, c_i·u_t: the row's number times the token's own). Where no common r
    holds, the earlier pieces run again with the true gradient (the two-pass cost for that row,
    not a wrong gradient)."""

    def __init__(self, backend, max_rows, h, w, b, targets, lp_opts, needs, entropy, positions,
                 mask, loss, open_rows):  # fmt: skip
        N, H = h.shape
        V = w.shape[0]
        self.backend, self.h, self.w, self.b, self.y = backend, h, w, b, targets
        self.opts, self.entropy, self.loss = lp_opts, entropy, loss
        self.positions, self.mask = positions, mask
        self.T = mask.shape[1]
        self.starts = [0]
        for n in mask.bool().sum(-1).tolist()[:-1]:
            self.starts.append(self.starts[-1] + n)
        self.acc = acc = _acc_dtype(h)
        self.logits = backend.logits_buffer(min(max_rows, N), V, h)
        self.logp = h.new_zeros(N, dtype=acc)
        self.ent = h.new_zeros(N, dtype=acc) if entropy else None
        self.dh = h.new_empty((N, H)) if needs[0] else None
        # dh rows are formed in fp32 (`acc`): straight into dh when it is fp32, else via a buffer
        self.dh_acc = None
        if needs[0] and h.dtype != acc:
            self.dh_acc = h.new_empty((min(max_rows, N), H), dtype=acc)
        self.dw = h.new_zeros((V, H), dtype=acc) if needs[1] else None
        self.db = h.new_zeros(V, dtype=acc) if needs[2] and b is not None else None
        self.written = False  # dw, db hold a chunk's terms (else the next one overwrites them)
        self.dw_open = None if self.dw is None or not open_rows else torch.empty_like(self.dw)
        self.db_open = None if self.db is None or not open_rows else torch.empty_like(self.db)
        # the open row: its earlier pieces, their gradients on the open dW's scale, and whether
        # no common scale held (`chunk`)
        self.pieces, self.stored, self.failed = [], [], False
        # Locality.BATCH: each token's provisional gradients, for `correct`
        self.provisional = None
        if loss.locality == Locality.BATCH:
            self.provisional = (h.new_zeros(N, dtype=acc), h.new_zeros(N, dtype=acc))

    def chunk(self, n0: int, n1: int, row: tuple[int, int] | None):
        """Chunk [n0, n1): whole units (`row` None), or a piece of the row [u0, u1)."""
        buf, lse, en = self.forward(n0, n1)
        if row is None:
            g, g_en = self.grads(n0, n1)
            self.backward(buf, n0, n1, lse, en, g, g_en)
            if self.provisional is not None:
                self.provisional[0][n0:n1] = g
                if g_en is not None:
                    self.provisional[1][n0:n1] = g_en
            return
        u0, u1 = row
        if n0 == u0:
            self.pieces, self.stored, self.failed = [], [], False
        if n1 < u1 and self.loss.token_part is not None:
            # an earlier piece on the scale of its tokens' own u_t, checked at the row's end
            with phases.phase("open_row_part"):
                u = self.loss.token_part(self.positions[n0:n1], self.logp[n0:n1]).to(self.acc)
            self.pieces.append((n0, n1))
            self.backward(buf, n0, n1, lse, en, u, None, opened=n0 > u0)
            self.stored.append((u, None))
            return
        if self.failed and n1 < u1:
            self.pieces.append((n0, n1))  # no common scale: runs again at the row's end
            return
        g, g_en = self.grads(u0, n1)  # the row so far live: at its last piece, its true gradient
        # r None: no common scale (now or, at the last piece, at an earlier one)
        r = None if self.failed else 1.0 if n0 == u0 else _common_scale(
            g, g_en, self.stored, n0 - u0)  # fmt: skip
        g_p, g_en_p = g[n0 - u0 :], None if g_en is None else g_en[n0 - u0 :]
        if n1 == u1:
            # with a common scale the open row's dW and db join dW and db in this backward
            fold = None if r is None else (self.dw_open, self.db_open, r)
            self.backward(buf, n0, n1, lse, en, g_p, g_en_p, fold=fold)
            self.close(u0, n0, r, g, g_en)
            return
        self.pieces.append((n0, n1))
        # this piece's gradient on the scale of the open row's dW
        scaled = None if r is None else _rescale(r, g_p, g_en_p)
        if scaled is None:
            self.failed = True  # no common scale: the earlier pieces run again at the row's end
            return
        self.backward(buf, n0, n1, lse, en, *scaled, opened=n0 > u0)
        self.stored.append(scaled)

    def forward(self, n0, n1):
        buf = self.logits[: n1 - n0]
        lp, lse, en = self.backend.logits_fwd(self.h[n0:n1], self.w, self.y[n0:n1], self.b,
                                              self.opts, self.entropy, buf)  # fmt: skip
        self.logp[n0:n1] = lp
        if self.ent is not None:
            self.ent[n0:n1] = en
        return buf, lse, en

    def grads(self, n0, n1):
        """(dL/dlogp, dL/dentropy | None) [n1 − n0] of the tokens [n0, n1), from `loss.grad` on
        the rows they lie in with those tokens alone live."""
        T, loss = self.T, self.loss
        rows = _row_span(self.starts, n0, n1, loss.locality, loss.group)
        local = self.positions[n0:n1] - rows.start * T

        def scatter(x):
            return x.new_zeros((rows.stop - rows.start) * T).index_copy_(0, local, x).view(-1, T)

        lp = self.logp[n0:n1]
        m = scatter(torch.ones_like(lp, dtype=self.mask.dtype))
        with phases.phase("epilogue"):
            en = None if self.ent is None else scatter(self.ent[n0:n1])
            d_lp, d_en = loss.grad(rows, m, scatter(lp), en)
        g = d_lp.reshape(-1).index_select(0, local).to(self.acc)
        g_en = None if d_en is None else d_en.reshape(-1).index_select(0, local).to(self.acc)
        return g, g_en

    def backward(self, buf, n0, n1, lse, en, g, g_en, opened=None, fold=None):
        """The chunk's dh rows and its dW, db terms: into dw, db, or with `opened` (True: the
        open row has earlier pieces) into the open row's; `fold` (the open row's dW, db and r,
        at its last piece): dw, db also take r times those, in the backend's same sweeps over
        the vocabulary (`backends.fold_into`)."""
        d_h = None if self.dh is None else self.dh[n0:n1] if self.dh_acc is None else (
            self.dh_acc[: n1 - n0])  # fmt: skip
        if opened is None:
            dw, db, accumulate = self.dw, self.db, self.written
            self.written = True
        else:
            dw, db, accumulate = self.dw_open, self.db_open, opened
        self.backend.logits_bwd(buf, self.h[n0:n1], self.w, self.y[n0:n1], self.b, lse, en, g,
                                g_en, self.opts, d_h, dw, db, accumulate, fold=fold)  # fmt: skip
        if self.dh_acc is not None:
            self.dh[n0:n1] = d_h

    def close(self, u0, n0, r, g, g_en):
        """The end of the row [u0, ·) whose earlier pieces are [u0, n0): their dh rows times `r`
        (the last piece's backward took the open row's dW and db times r), or (r None) those
        pieces run again with `g`, `g_en`, the row's true gradients from u0 on."""
        if r is None:
            with phases.phase("open_row_rerun"):
                for p0, p1 in self.pieces:
                    buf, lse, en = self.forward(p0, p1)
                    ge = None if g_en is None else g_en[p0 - u0 : p1 - u0]
                    self.backward(buf, p0, p1, lse, en, g[p0 - u0 : p1 - u0], ge)
        else:
            with phases.phase("open_row_fold"):
                if self.dh is not None:
                    self.dh[u0:n0] *= r
        self.pieces, self.stored, self.failed = [], [], False

    def correct(self):
        """Locality.BATCH: the true gradients of every token (the whole batch live), and for
        the tokens where they differ from the provisional ones (beyond 128 ulps) their logits
        once more, in chunks, with the difference as upstream: dz is linear in it, so dW, db
        and those dh rows become exact. kl_cov corrects its top-k tokens, M2PO those its τ
        masks."""
        N = self.logp.shape[0]
        if N == 0:
            return
        g, g_en = self.grads(0, N)
        d = g - self.provisional[0]
        d_en = None if g_en is None else g_en - self.provisional[1]
        off = ~_agree(g, self.provisional[0])
        if d_en is not None:
            off |= ~_agree(g_en, self.provisional[1])
        idx = off.nonzero().flatten()
        rows = self.logits.shape[0]
        for k0 in range(0, idx.numel(), rows):
            with phases.phase("batch_correction"):
                self._rerun(idx[k0 : k0 + rows], d, d_en)

    def _rerun(self, idx, d, d_en):
        """The tokens `idx` once more with upstream `d`, `d_en`: dW, db accumulated, their dh
        rows added to."""
        h, y = self.h.index_select(0, idx), self.y.index_select(0, idx)
        buf = self.logits[: idx.numel()]
        _, lse, en = self.backend.logits_fwd(h, self.w, y, self.b, self.opts, self.entropy, buf)
        d_h = None if self.dh is None else h.new_empty(h.shape, dtype=self.acc)
        ge = None if d_en is None else d_en.index_select(0, idx)
        self.backend.logits_bwd(buf, h, self.w, y, self.b, lse, en, d.index_select(0, idx), ge,
                                self.opts, d_h, self.dw, self.db, self.written)  # fmt: skip
        self.written = True
        if d_h is not None:
            self.dh.index_add_(0, idx, d_h.to(self.dh.dtype))


def _common_scale(g, g_en, stored, early: int) -> float | None:
    """r with (g, g_en) = r·(the stored provisional gradients) on the row's first `early` tokens,
    each to 128 ulps, or None."""
    y = g[:early] if g_en is None else torch.cat([g[:early], g_en[:early]])
    # a piece stored without dL/dentropy (`token_part`) took none: 0
    en = [] if g_en is None else [torch.zeros_like(s[0]) if s[1] is None else s[1] for s in stored]
    x = torch.cat([s[0] for s in stored] + en)
    if x.numel() != y.numel():
        return None
    x, y = x.double(), y.double()
    den = float((x * x).sum())
    r = float((x * y).sum()) / den if den > 0 else 0.0
    # token by token: a row's outlier (a log-ratio of 30 in a KL term) must not hide the rest
    return r if bool(_agree(y, r * x, torch.finfo(g.dtype).eps).all()) else None


def _agree(a: torch.Tensor, b: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Element by element, a and b within 128 ulps (of `eps`, else a's dtype) of the larger."""
    eps = torch.finfo(a.dtype).eps if eps is None else eps
    return (a - b).abs() <= 128 * eps * torch.maximum(a.abs(), b.abs())


def _rescale(r: float, *grads):
    """Each of `grads` (None stays None) divided by r; None where no one scale holds them and
    the open row's dW: r is 0 and they are not, or the quotient overflows."""
    if r == 0.0:
        if any(g is not None and bool(g.any()) for g in grads):
            return None
        return tuple(None if g is None else torch.zeros_like(g) for g in grads)
    out = tuple(None if g is None else g / r for g in grads)
    return out if all(g is None or bool(g.isfinite().all()) for g in out) else None


# ----------------------------------------------------------------------------- the losses


def _rows(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def uniform_part(idx: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """The `ChunkedLoss.token_part` of a loss whose row factor has the same gradient on each of
    the row's tokens: GSPO's sequence ratio s_i = exp(Σ m·l / L_i) (each token's loss term, a
    vLLM IS ratio ρ_t's included, is a function of s_i: ρ weighs c_i, not u_t), f-GRPO's and
    FDO's sequence log-ratio. u_t = 1."""
    return torch.ones_like(lp)


def grpo(old, ref, mask, advantages, ratio, sampling, norms, opts: GRPOOptions) -> ChunkedLoss:
    """The GRPO family on the batch's `grpo_math.Normalisers` (row scales and the entropy
    bonus's scale, computed up front; no entropy mask): per-token terms, except a GSPO ratio
    (but on-policy, where it is 1), VESPO's weight and the off-policy mask, which are
    statistics of whole sequences. The GSPO ratio alone (no β term, no entropy bonus) scales a
    row's gradient: open rows."""
    sequence_weight = grpo_math.POLICY_TERMS[opts.objective].sequence_weight
    # on-policy (old log-probs None: the current ones, detached) GSPO's ratio is exp(0) = 1
    # whatever the other tokens: a token's gradient needs its row's mask count alone
    on_policy_gspo = opts.level == Level.SEQUENCE and old is None
    per_row = ((opts.level == Level.SEQUENCE and not on_policy_gspo) or sequence_weight
               or opts.off_policy_mask_threshold is not None)  # fmt: skip
    scaled = (opts.level == Level.SEQUENCE and not sequence_weight and opts.beta == 0.0
              and opts.off_policy_mask_threshold is None and opts.entropy_coef == 0.0)  # fmt: skip

    def grad(rows, m, lp, ent):
        if scaled or on_policy_gspo:
            # the row's whole mask, its absent tokens at log-ratio 0 (at their old log-probs; on
            # policy any value: old is the current one): an open row's mean log-ratio so far is
            # damped towards the whole row's, as the policy variants do, and its clip side
            # changes (and the fold fails) less often than on the live mean
            fill = 0.0 if old is None else old[rows].to(lp.dtype)
            lp, m = torch.where(m.bool(), lp, fill), mask[rows]
        sub = grpo_math.Normalisers(norms.row_scale[rows], None, norms.entropy_scale)
        _, d, d_ent = epilogue.grpo(lp, ent, _rows(old, rows), _rows(ref, rows), m,
                                    advantages[rows], _rows(ratio, rows), _rows(sampling, rows),
                                    sub, opts)  # fmt: skip
        return d, d_ent

    def loss(lp, ent):
        out = epilogue.grpo(lp, ent, old, ref, mask, advantages, ratio, sampling, norms, opts)
        return out[0]

    return ChunkedLoss(Locality.ROW if per_row else Locality.TOKEN, grad, loss, scaled=scaled,
                       token_part=uniform_part)  # fmt: skip


def fgrpo(ref, mask, advantages, rewards, old, ratio, opts: FGRPOOptions) -> ChunkedLoss:
    """f-GRPO: the units' costs summed on the chunk, times the reduction's weight of each row
    (1/max(Σ mask, 1), 1/(B·max(L_i, 1)), 1/B or 1); advantages from rewards up front (float64
    group statistics, as the kernels compute them); the entropy bonus's gradient
    −c·mask/max(Σ mask, 1) (`grpo_math.entropy_bonus`). Sequence level needs whole sequences
    (or open rows: φ'(β·r_i) scales the row, where no entropy bonus adds a token's own term),
    the group importance weights whole groups."""
    B = mask.shape[0]
    m = mask.to(torch.float32)
    a = advantages
    if a is None:
        a = epilogue.fgrpo_advantages(rewards, opts)
    if opts.reduction == Reduction.TOKEN_MEAN:
        weight = (1.0 / m.sum().clamp(min=1.0)).expand(B)
    elif opts.reduction == Reduction.SEQ_MEAN:
        length = m.sum(-1).clamp(min=1.0)
        weight = 1.0 / (B * (length if opts.level == Level.TOKEN else torch.ones_like(length)))
    else:
        weight = torch.ones_like(m[:, 0])
    bonus = opts.entropy_coef / m.sum().clamp(min=1.0)
    unit = dataclasses.replace(opts, reduction=Reduction.SUM, entropy_coef=0.0)

    def grad(rows, m, lp, ent):
        rw = old_rows = None
        if opts.group_is_weights:
            rw, old_rows = rewards[rows], lp.detach() if old is None else old[rows]
        _, d, _ = epilogue.fgrpo(lp, None, ref[rows], m, a[rows], rw, old_rows,
                                 _rows(ratio, rows), unit)  # fmt: skip
        d_ent = None if opts.entropy_coef == 0.0 else -bonus * m.to(d.dtype)
        return d * weight[rows, None].to(d.dtype), d_ent

    def loss(lp, ent):
        full_old = (lp.detach() if old is None else old) if opts.group_is_weights else None
        out = epilogue.fgrpo(lp, ent, ref, mask, advantages, rewards, full_old, ratio, opts)
        return out[0]

    if opts.group_is_weights:
        return ChunkedLoss(Locality.GROUP, grad, loss, opts.num_generations)
    if opts.level == Level.TOKEN:
        return ChunkedLoss(Locality.TOKEN, grad, loss)
    return ChunkedLoss(Locality.ROW, grad, loss, scaled=opts.entropy_coef == 0.0,
                       token_part=uniform_part)  # fmt: skip


def gift(ref, mask, rewards, opts: GIFTOptions) -> ChunkedLoss:
    """GIFT: z-scores within groups, so whole groups; the chunk's mean over its b rows is
    rescaled to the batch's mean over B rows."""
    B = mask.shape[0]

    def grad(rows, m, lp, ent):
        _, d = epilogue.gift(lp, ref[rows], m, rewards[rows], opts)[:2]
        return d * ((rows.stop - rows.start) / B), None

    def loss(lp, ent):
        return epilogue.gift(lp, ref, mask, rewards, opts)[0]

    return ChunkedLoss(Locality.GROUP, grad, loss, opts.num_generations)


def fdo(ref, mask, chosen, opts: FDOOptions) -> ChunkedLoss:
    """FDO: sequence-level f-GRPO with advantages ±1/(pool size) counted up front; whole
    sequences, or open rows."""
    advantages, seq = epilogue.fdo_as_fgrpo(chosen, opts)

    def grad(rows, m, lp, ent):
        _, d, _ = epilogue.fgrpo(lp, None, ref[rows], m, advantages[rows], None, None, None, seq)
        return d, None

    def loss(lp, ent):
        return epilogue.fdo(lp, ref, mask, chosen, opts)[0]

    return ChunkedLoss(Locality.ROW, grad, loss, scaled=True, token_part=uniform_part)
