"""Shared pieces of the loss epilogue kernels: `tl_` helpers and launch plumbing.

A program owns ROWS contiguous rows (a group of `num_generations` completions, or one row when
no group statistic is needed), held as a [BLOCK_G] vector; per-token tensors are walked in
[BLOCK_G, BLOCK_T] tiles along T, with 64-bit offsets (row · T + t).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Elements of one [BLOCK_G, BLOCK_T] tile; tests shrink it so that the loops over T iterate.
TILE = 4096


# ----------------------------------------------------------------------------- tl_ helpers


@triton.jit
def tl_rows(B, T, ROWS, BLOCK_G: tl.constexpr):
    """This program's rows [BLOCK_G], which of them exist, and their 64-bit base offsets."""
    idx = tl.arange(0, BLOCK_G)
    rows = tl.program_id(0) * ROWS + idx
    row_ok = (idx < ROWS) & (rows < B)
    return rows, row_ok, rows.to(tl.int64) * T


@triton.jit
def tl_tile(base, row_ok, t0, T, BLOCK_T: tl.constexpr):
    """Offsets [BLOCK_G, BLOCK_T] of the tile at column t0, and which of them exist."""
    cols = t0 + tl.arange(0, BLOCK_T)
    offs = base[:, None] + cols[None, :]
    return offs, row_ok[:, None] & (cols < T)[None, :]


@triton.jit
def tl_load(ptr, offs, ok):
    return tl.load(ptr + offs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def tl_load_mask(ptr, offs, ok):
    """The 0/1 mask (bool, integer or floating storage) as a boolean tile."""
    return tl.load(ptr + offs, mask=ok, other=0) != 0


@triton.jit
def tl_row_sums(
    x_ptr,
    y_ptr,
    z_ptr,
    mask_ptr,
    base,
    row_ok,
    T,
    HAS_Y: tl.constexpr,
    HAS_Z: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Per-row Σ_t m·(x − y) (Σ_t m·x without y), L = Σ_t m and Σ_t m·z, each [BLOCK_G]
    float64.

    NB: a sum of T log-probs is hundreds, and what uses it is sensitive to its absolute error:
    exp(β·Σ) in φ, softmax_j(R_j − S_j) in the IS weights. Summed in fp32 it is off by ulps of
    the total (3e-5 relative in the IS weights seen); in float64 it is exact to fp32 inputs."""
    s_xy = tl.zeros([BLOCK_G], dtype=tl.float64)
    s_m = tl.zeros([BLOCK_G], dtype=tl.float64)
    s_z = tl.zeros([BLOCK_G], dtype=tl.float64)
    for t0 in range(0, T, BLOCK_T):
        offs, ok = tl_tile(base, row_ok, t0, T, BLOCK_T)
        m = tl_load_mask(mask_ptr, offs, ok)
        d = tl_load(x_ptr, offs, ok).to(tl.float64)
        if HAS_Y:
            d = d - tl_load(y_ptr, offs, ok).to(tl.float64)
        s_xy += tl.sum(tl.where(m, d, 0.0), axis=1)
        s_m += tl.sum(m.to(tl.float64), axis=1)
        if HAS_Z:
            s_z += tl.sum(tl.where(m, tl_load(z_ptr, offs, ok).to(tl.float64), 0.0), axis=1)
    return s_xy, s_m, s_z


@triton.jit
def tl_store_row_grad(dlogp_ptr, mask_ptr, base, row_ok, coef, T, BLOCK_T: tl.constexpr):
    """dL/dlogp[i, t] = coef_i · m[i, t], for a loss that sees row i only through Σ_t m·logp."""
    for t0 in range(0, T, BLOCK_T):
        offs, ok = tl_tile(base, row_ok, t0, T, BLOCK_T)
        m = tl_load_mask(mask_ptr, offs, ok)
        tl.store(dlogp_ptr + offs, tl.where(m, coef[:, None], 0.0), mask=ok)


@triton.jit
def tl_group_center(x, ok, n, dof):
    """Centred values c = x − μ and σ = sqrt(Σ c² / dof) of the group `ok` (n members).

    NB: the kernels pass float64 (O(G) work per program). A flat group of fp32 rewards then
    centres to exactly 0, where an fp32 Σx/n is off by an ulp for n = 3, 5, 6, 7 and
    (x − μ)/(σ + eps) blows that up to ~1e-3."""
    mu = tl.sum(tl.where(ok, x, 0.0), axis=0) / n
    c = tl.where(ok, x - mu, 0.0)
    var = tl.sum(c * c, axis=0) / dof
    if x.dtype == tl.float64:
        root = tl.sqrt(tl.maximum(var, 0.0))  # sqrt.rn.f64: fp64 square roots are exact
    else:
        root = tl.sqrt_rn(tl.maximum(var, 0.0))
    return c, tl.where(var > 0, root, 0.0)


@triton.jit
def tl_safe_inv(d):
    """1/d where d > 0, else 0 (the reference's guarded division: no slope, never NaN)."""
    return tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)


@triton.jit
def tl_group_zscore(x, ok, n, dof, eps):
    """(c, σ, z) of the group: z = c / (σ + eps), 0 where σ + eps = 0."""
    c, sigma = tl_group_center(x, ok, n, dof)
    return c, sigma, c * tl_safe_inv(sigma + eps)


# ----------------------------------------------------------------------------- launching


def contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def row_block(B: int, T: int) -> int:
    """Rows per program when no group statistic is needed: short rows are packed into a tile."""
    return max(1, min(B, TILE // triton.next_power_of_2(max(T, 1))))


def blocks(rows: int, T: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_T) for programs of `rows` rows over T tokens."""
    block_g = triton.next_power_of_2(max(rows, 1))
    block_t = min(triton.next_power_of_2(max(T, 1)), max(TILE // block_g, 1))
    return block_g, block_t


def num_warps(block_g: int, block_t: int) -> int:
    """4 warps up to 2048 elements a tile, 8 beyond (16 fp32 per thread and tensor at most)."""
    return 8 if block_g * block_t > 2048 else 4


def device_scalar(value, device: torch.device) -> torch.Tensor:
    """A 1-element fp32 tensor on `device` (a normaliser the kernel loads: no host sync)."""
    return torch.as_tensor(value, dtype=torch.float32, device=device).reshape(1)


def dof(n: int, unbiased: bool) -> float:
    """The variance denominator: n − 1 (Bessel) or n, at least 1 (a group of one has σ = 0)."""
    return float(max(n - 1 if unbiased else n, 1))


@dataclass(frozen=True)
class Plan:
    """One launch: the grid, the outputs (dL/dlogp [B, T] and one partial loss per program)
    and the tile meta-parameters (BLOCK_G, BLOCK_T, num_warps)."""

    grid: tuple[int]
    dlogp: torch.Tensor
    partial: torch.Tensor
    meta: dict

    @staticmethod
    def of(B: int, T: int, rows: int, device: torch.device) -> Plan:
        block_g, block_t = blocks(rows, T)
        grid = (triton.cdiv(B, rows),)
        meta = {"BLOCK_G": block_g, "BLOCK_T": block_t, "num_warps": num_warps(block_g, block_t)}
        dlogp = torch.empty((B, T), dtype=torch.float32, device=device)
        return Plan(grid, dlogp, torch.empty(grid[0], dtype=torch.float32, device=device), meta)

    def group_args(self, rows: int, opts) -> tuple:
        """The launch arguments (dlogp, partial, B, T, ROWS, beta, eps, var_dof), in this order,
        of the kernels that z-score per group of `rows` rows (f-GRPO, GIFT): opts.beta,
        opts.eps and the variance denominator of opts.unbiased."""
        B, T = self.dlogp.shape
        beta, eps, var_dof = float(opts.beta), float(opts.eps), dof(rows, opts.unbiased)
        return self.dlogp, self.partial, B, T, rows, beta, eps, var_dof

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, dL/dlogp): the partial sums added in torch (deterministic, no atomics)."""
        return self.partial.sum(), self.dlogp
