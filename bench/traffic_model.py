"""The single pass's traffic model (docs/gpu-performance.md): ESTIMATED ms per phase of the
GRPO loss (and of the log-prob primitive through the cuBLAS chunks, $FGRPO_PRIMITIVE=cublas)
at H 4096, V 151936, bf16, for a buffer size and N, at a GEMM rate and a bandwidth.

    python bench/traffic_model.py [--bw-tbs 4.8]

GEMM time per N from the 2026-12-04 H200 run (cuBLAS 2·N·H·V: 13.47 ms at 8k, 58.47 at 32k,
116.9 at 64k; 16k interpolated); the bandwidth is the H200's nominal 4.8 TB/s (an assumption,
not measured). Model, each term additive (pessimistic: nothing overlaps):
    GEMMs      3 products of 2·N·H·V (logits, dh, dW) at the measured cuBLAS time; the
               primitive 4 (its backward recomputes the logits)
    row passes 10 B per logit / BW: the stats kernel reads the fp32 logits (4), the grad
               kernel reads them again (4) and writes the bf16 dlogits (2); the GEMMs' own
               fp32 write and bf16 reads are inside their measured time
    dW r/w     per chunk the fp32 dW [V, H] read and rewritten by the accumulating product
               (8·V·H B) / BW
Rows per chunk are the code's: `backends.triton.bytes_per_row` (fp32 logits + bf16 dlogits).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fgrpo_kernels.backends.triton import bytes_per_row  # noqa: E402

H, V = 4096, 151936
GEMM_MS = {8192: 13.47, 16384: 13.47 + (58.47 - 13.47) * (16384 - 8192) / (32768 - 8192),
           32768: 58.47, 65536: 116.9}  # fmt: skip
MEASURED_1GIB = {8192: 55.92, 32768: 214.7, 65536: 440.6}  # 2026-12-04, ours_grpo_single
# 2026-12-04, fwd+bwd: the primitive through the Triton tiles, and Liger's (Triton) FLCE
MEASURED_TILES = {8192: 74.0, 32768: 306.2, 65536: 609.3}
MEASURED_LIGER_FLCE = {8192: 111.7, 32768: 282.1, 65536: 550.2}
GEMMS = {"loss": 3, "primitive": 4}
BUFFERS_GIB = (0.5, 1, 1.68, 2, 4, 8)  # 1.68: 4 GiB less the fp32 dW (2.32 GiB)


def model(N: int, budget: float, bw: float = 4.8e12, kind: str = "loss") -> dict:
    """Modelled ms of the single-pass loss (or the cuBLAS-chunk primitive) at N rows with a
    `budget`-byte buffer."""
    if kind not in GEMMS:
        raise ValueError(f"kind: expected one of {sorted(GEMMS)}; got {kind!r}")
    if N not in GEMM_MS:
        raise ValueError(f"N: expected one of {sorted(GEMM_MS)}; got {N}")
    if budget <= 0 or bw <= 0:
        raise ValueError(f"budget and bw: expected > 0; got {budget}, {bw}")
    per_row = bytes_per_row(torch.empty(0, dtype=torch.bfloat16), V)
    rows = int(budget // per_row)
    if rows == 0:
        raise ValueError(f"budget: {budget} B holds no row of {per_row} B")
    chunks = -(-N // rows)
    gemm = GEMMS[kind] * GEMM_MS[N]
    row_k = 10 * N * V / bw * 1e3
    dw = chunks * 8 * V * H / bw * 1e3
    total = gemm + row_k + dw
    return {"rows": rows, "chunks": chunks, "gemm_ms": gemm, "rows_ms": row_k, "dw_ms": dw,
            "total_ms": total, "ratio": total / gemm}  # fmt: skip


def table(bw: float) -> str:
    out = [
        "| N | buffer GiB | rows | chunks | GEMMs ms | row passes ms | dW r/w ms | estimate ms |"
        " estimate × 6NHV | measured 2026-12-04 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for N in sorted(GEMM_MS):
        for gib in BUFFERS_GIB:
            m = model(N, gib * 2**30, bw)
            seen = MEASURED_1GIB.get(N) if gib == 1 else None
            seen = f"{seen} ms ({seen / m['gemm_ms']:.2f}×)" if seen else "–"
            out.append(
                f"| {N} | {gib} | {m['rows']} | {m['chunks']} | {m['gemm_ms']:.1f} | "
                f"{m['rows_ms']:.1f} | {m['dw_ms']:.1f} | {m['total_ms']:.1f} | "
                f"{m['ratio']:.3f} | {seen} |"
            )
    out += [
        "",
        "| N | buffer GiB | chunks | GEMMs ms | estimate ms | estimate × 8NHV |"
        " measured tiles 2026-12-04 | measured Liger FLCE 2026-12-04 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for N in sorted(GEMM_MS):
        for gib in (1, 4):
            m = model(N, gib * 2**30, bw, "primitive")
            tiles, liger = MEASURED_TILES.get(N), MEASURED_LIGER_FLCE.get(N)
            tiles = f"{tiles} ms ({tiles / m['gemm_ms']:.2f}×)" if tiles else "–"
            out.append(
                f"| {N} | {gib} | {m['chunks']} | {m['gemm_ms']:.1f} | {m['total_ms']:.1f} | "
                f"{m['ratio']:.3f} | {tiles} | {f'{liger} ms' if liger else '–'} |"
            )
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bw-tbs", type=float, default=4.8)
    print(table(ap.parse_args(argv).bw_tbs * 1e12))


if __name__ == "__main__":
    main()
