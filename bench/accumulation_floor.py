"""The fp32 accumulation floor of the log-probs of a long dot product, measured on the CPU.

    python bench/accumulation_floor.py --H 16384 [--N 64 --V 8192 --seeds 3]

Inputs drawn as bench/gpu_correctness.py draws them (hidden N(0, 1), weight N(0, 1)·2/√H, bias
N(0, 1)·0.5, all rounded to bf16; τ 1), logits z = h·W^T + b accumulated over K = H in three
ways, then logp = z_y − logsumexp(z) against the float64 computation:

    rne_k64   fp32 accumulator, one exact product of each 64-wide K block (BLOCK_K of the Triton
              tiles) added with round-to-nearest: the IEEE floor, what the interpreter computes
    rne_k16   the same with 16-wide steps (one Hopper wgmma K step for bf16)
    sgemm     torch's float32 product on the CPU (the BLAS's own blocking, round to nearest)
    rz_k16    16-wide steps, each sum truncated toward zero: a model of tensor-core
              accumulation (significands aligned and truncated; Fasi et al. 2021 measured
              round-toward-zero accumulation on V100/T4/A100 tensor cores)

V is a slice of the vocabulary (the lse error is a softmax-weighted mean of the logit errors,
which the slice estimates); prints one row per mode: max |Δlogp| over the N·seeds rows, its
RMS, and the logits' max |Δz|.
"""

from __future__ import annotations

import argparse

import torch


def round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float64 → the float32 next to x toward zero (x's RNE rounding, stepped back when it
    rounded away from zero)."""
    y = x.float()
    away = y.double().abs() > x.abs()
    return torch.where(away, torch.nextafter(y, torch.zeros_like(y)), y)


def logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """h [N, K], w [V, K] float64 (bf16 values), b [V]: fp32 logits accumulated per `mode`;
    "exact" is the float64 product."""
    if mode == "exact":
        return h @ w.T + b
    if mode == "sgemm":
        return h.float() @ w.float().T + b.float()
    step = 64 if mode.endswith("k64") else 16
    acc = torch.zeros(h.shape[0], w.shape[0], dtype=torch.float32)
    for k0 in range(0, h.shape[1], step):
        part = h[:, k0 : k0 + step] @ w[:, k0 : k0 + step].T  # exact: ≤ 64 bf16·bf16 products
        total = acc.double() + part
        acc = round_toward_zero(total) if mode.startswith("rz") else total.float()
    return acc + b.float()


MODES = ("rne_k64", "rne_k16", "sgemm", "rz_k16")


def measure(H: int, N: int, V: int, seeds: int, modes=MODES) -> dict:
    """mode -> (max |Δlogp|, rms |Δlogp|, max |Δz|) against float64."""
    err = {m: [] for m in modes}
    dz = {m: 0.0 for m in modes}
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(N, H, generator=g).bfloat16().double()
        w = (torch.randn(V, H, generator=g) * (2.0 / H**0.5)).bfloat16().double()
        b = (torch.randn(V, generator=g) * 0.5).bfloat16().double()
        y = torch.randint(0, V, (N,), generator=g)
        z = logits(h, w, b, "exact")
        want = z.gather(1, y[:, None])[:, 0] - z.logsumexp(1)
        for m in modes:
            zf = logits(h, w, b, m)
            dz[m] = max(dz[m], float((zf.double() - z).abs().max()))
            # lse and the pick in fp32 as the row kernels do (exp/log errors are ~1e-7)
            got = zf.gather(1, y[:, None])[:, 0] - zf.logsumexp(1)
            err[m].append((got.double() - want).abs())
    out = {}
    for m in modes:
        e = torch.cat(err[m])
        out[m] = (float(e.max()), float(e.pow(2).mean().sqrt()), dz[m])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--H", type=int, nargs="+", default=[16384])
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--V", type=int, default=8192)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    print("H,N,V,seeds,mode,logp_max_abs,logp_rms,logits_max_abs", flush=True)
    for H in args.H:
        for m, (mx, rms, z) in measure(H, args.N, args.V, args.seeds).items():
            print(f"{H},{args.N},{args.V},{args.seeds},{m},{mx:.3g},{rms:.3g},{z:.3g}", flush=True)


if __name__ == "__main__":
    main()
