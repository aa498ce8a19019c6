"""Where the work runs: Triton kernels (`triton/`), the CPU paths (`cpu/`: C++ and chunked
torch), the vocabulary-parallel layout and collectives (`distributed`). Tensors in, tensors out:
nothing here knows a loss."""

import torch


def fold_into(dw, db, fold, accumulate: bool) -> bool:
    """`fold` (dw_src, db_src, alpha) into dw, db ahead of a chunk's terms: dw (+)= alpha·dw_src,
    db (+)= alpha·db_src, added to with `accumulate`, else written (a None target is not
    wanted, a None source leaves its target to the chunk). Whether the chunk then adds to them:
    the backends without a fused fold call this first."""
    if fold is None:
        return accumulate
    src_w, src_b, alpha = fold
    for dst, src in ((dw, src_w), (db, src_b)):
        if dst is None:
            continue
        if src is None:
            if not accumulate:
                dst.zero_()
        elif accumulate:
            dst.add_(src, alpha=alpha)
        else:
            torch.mul(src, alpha, out=dst)
    return True
