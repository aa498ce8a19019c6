// Shared pieces of the C++ CPU backend of the fused linear log-prob: tile sizes, the
// single-threaded fp32 GEMM on tiles, fp32 views of bf16/fp16 tiles.
//
// Determinism: every tile product is one single-threaded sgemm whose shape and operands depend
// only on the tile's position, never on the thread that runs it, and every reduction across
// tokens runs in a fixed order inside one task. Same inputs → bitwise the same outputs, whatever
// the number of threads.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace fgrpo {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

constexpr int64_t BLOCK_N = 256;   // tokens per block: one task of the token-parallel loops
constexpr int64_t BLOCK_V = 1024;  // vocab entries per forward logits tile (1 MiB of fp32)
constexpr int64_t SUPER_V = 1024;  // vocab entries per backward sweep (dz buffer width)
constexpr int64_t CHUNK_N = 4096;  // tokens per backward sweep (dz buffer height)
constexpr int64_t SUB_V = 256;     // dW task: SUB_V vocab rows x SUB_H hidden columns (wider
constexpr int64_t SUB_H = 512;     // pieces run sgemm faster on this K = CHUNK_N: 81 vs 75 GFLOP/s)

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// e^u is exactly 0 in fp32 for u below this (the smallest denormal is e^-103.3). A factor that
// multiplies e^u takes max(u, EXP_ZERO_BELOW) instead of u, so banned tokens (u = −inf) and
// tokens far below the max (u ≈ −1e20 at a tiny temperature) contribute 0, never 0·∞.
constexpr float EXP_ZERO_BELOW = -128.f;

// The online log-sum-exp of one row over its vocab tiles: m = running max, s = Σ e^(z−m),
// t = Σ e^(z−m)(z−m) (for the entropy), z_y = the target's logit.
struct RowState {
  float m = -std::numeric_limits<float>::infinity();
  float s = 0.f;
  float t = 0.f;
  float z_y = 0.f;
};

// Folds one tile row z[0, cols) into the running (m, s, t) of its row; returns the reference
// m_ref the tile's e^(z − m_ref) were taken against, and with `store_exp` leaves those in z.
inline float online_update(float* z, int64_t cols, bool with_entropy, RowState& st,
                           bool store_exp = false) {
  constexpr int64_t W = Vec::size();
  const int64_t vec_end = cols - cols % W;
  Vec vmax(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < vec_end; j += W) vmax = at::vec::maximum(vmax, Vec::loadu(z + j));
  float tile_max = vmax.reduce_max();
  for (int64_t j = vec_end; j < cols; ++j) tile_max = std::max(tile_max, z[j]);
  const float m_new = std::max(st.m, tile_max);
  // NB: a tile of banned tokens (−inf) leaves m at −inf: shift by 0 (s, t stay 0), not −inf.
  const float m_ref = m_new == -std::numeric_limits<float>::infinity() ? 0.f : m_new;
  const Vec vm(m_ref), vfloor(EXP_ZERO_BELOW);
  Vec vs(0.f), vt(0.f);
  for (int64_t j = 0; j < vec_end; j += W) {
    const Vec u = Vec::loadu(z + j) - vm;
    const Vec e = u.exp();
    vs = vs + e;
    if (with_entropy) vt = at::vec::fmadd(e, at::vec::maximum(u, vfloor), vt);
    if (store_exp) e.store(z + j);
  }
  float s_tile = vs.reduce_add(), t_tile = vt.reduce_add();
  for (int64_t j = vec_end; j < cols; ++j) {
    const float u = z[j] - m_ref, e = std::exp(u);
    s_tile += e;
    t_tile += e * std::max(u, EXP_ZERO_BELOW);
    if (store_exp) z[j] = e;
  }
  if (st.m == -std::numeric_limits<float>::infinity()) {
    st.s = s_tile;
    st.t = t_tile;
  } else {
    const float shift = st.m - m_new, scale = std::exp(shift);
    st.t = scale * (st.t + shift * st.s) + t_tile;
    st.s = scale * st.s + s_tile;
  }
  st.m = m_new;
  return m_ref;
}

// Folds the logits tile z [rows, cols] (row stride ld, vocab entries v0 + j; the bias b, already
// divided by τ, not yet added) into the rows' online states, noting each target's logit (y: the
// rows' targets). With `m_ref` the tile is left as e^(z − m_t) (the target's entry keeps z_y)
// and each row's m_t is written to m_ref[r * m_ld].
inline void fold_tile(float* z, int64_t ld, int64_t rows, int64_t cols, int64_t v0,
                      const float* b, const int64_t* y, bool with_entropy, RowState* state,
                      float* m_ref = nullptr, int64_t m_ld = 0) {
  for (int64_t r = 0; r < rows; ++r) {
    float* zr = z + r * ld;
    if (b != nullptr) {
      for (int64_t j = 0; j < cols; ++j) zr[j] += b[v0 + j];
    }
    const int64_t local = y[r] - v0;
    const bool hit = local >= 0 && local < cols;
    if (hit) state[r].z_y = zr[local];
    const float m_t = online_update(zr, cols, with_entropy, state[r], m_ref != nullptr);
    if (m_ref == nullptr) continue;
    if (hit) zr[local] = state[r].z_y;
    m_ref[r * m_ld] = m_t;
  }
}

// lse, logp and entropy of a finished row (logp and entropy 0 where the target is ignored).
inline void finish_row(const RowState& st, bool valid, float* lse, float* logp, float* ent) {
  const float log_s = std::log(st.s);
  *lse = st.m + log_s;
  *logp = valid ? st.z_y - *lse : 0.f;
  if (ent != nullptr) *ent = valid ? log_s - st.t / st.s : 0.f;
}

// dz = p·(a + c·u) + onehot_y·gy per row, u = z − lse, p = e^u (docs/math.md §1, Backward):
// a = −(g + g_H·H)/τ, c = −g_H/τ, gy = g/τ; all 0 on an ignored row.
struct RowCoef {
  float a = 0.f;
  float c = 0.f;
  float gy = 0.f;
};

inline RowCoef row_coef(bool valid, float g, float gh, float ent, float inv_t) {
  if (!valid) return {};
  return {-(g + gh * ent) * inv_t, -gh * inv_t, g * inv_t};
}

// One row segment of logits (bias not yet added when b is given) → dz in place. `local` is the
// target's column in the segment, or −1. p = 0 tokens (u = −inf, or far below the max) give
// dz = 0: u is floored at EXP_ZERO_BELOW in the factor (a + c·u), where e^u is already 0.
inline void dlogits_row(float* zr, const float* b, int64_t cols, int64_t local, float lse,
                        RowCoef k) {
  if (k.a == 0.f && k.c == 0.f && k.gy == 0.f) {
    std::memset(zr, 0, sizeof(float) * cols);
    return;
  }
  const float u_y = local >= 0 ? zr[local] + (b != nullptr ? b[local] : 0.f) - lse : 0.f;
  constexpr int64_t W = Vec::size();
  const int64_t vec_end = cols - cols % W;
  const Vec vl(lse), va(k.a), vc(k.c), vfloor(EXP_ZERO_BELOW);
  for (int64_t j = 0; j < vec_end; j += W) {
    Vec z = Vec::loadu(zr + j);
    if (b != nullptr) z = z + Vec::loadu(b + j);
    const Vec u = z - vl;
    (u.exp() * at::vec::fmadd(vc, at::vec::maximum(u, vfloor), va)).store(zr + j);
  }
  for (int64_t j = vec_end; j < cols; ++j) {
    const float u = zr[j] + (b != nullptr ? b[j] : 0.f) - lse;
    zr[j] = std::exp(u) * (k.a + k.c * std::max(u, EXP_ZERO_BELOW));
  }
  // NB: the target's g·(1 − p_y)/τ as −(g/τ)·expm1(u_y): a near-certain target keeps its
  // precision (1 − p_y would cancel).
  if (local >= 0) {
    const float u_lin = std::max(u_y, EXP_ZERO_BELOW);
    zr[local] = -k.gy * std::expm1(u_y) + std::exp(u_y) * (k.a + k.gy + k.c * u_lin);
  }
}

// Row-major C[m, n] = alpha * A[m, k] · op(B) + beta * C, single-threaded (tiles.cpp).
// op(B) = B^T with B [n, k] (nt), B [k, n] (nn); tn: C = alpha * A^T · B with A [k, m].
void gemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_tn(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Forces the BLAS of the calling thread to one thread while alive (MKL; a no-op elsewhere).
struct SerialBlas {
  SerialBlas();
  ~SerialBlas();
  int previous;
};

inline int task_threads(int64_t tasks) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks)));
}

// f(task, thread) for task in [0, tasks) on task_threads(tasks) OpenMP threads, dynamically
// scheduled: which thread runs a task never changes what the task computes. f must not throw.
template <typename F>
void parallel_tasks(int64_t tasks, const F& f) {
  const int threads = task_threads(tasks);
#pragma omp parallel num_threads(threads)
  {
    SerialBlas serial;
    const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) f(task, thread);
  }
}

// Rows [r0, r0 + rows) of a [*, cols] tensor as fp32: a pointer into `t` when it is fp32,
// else converted into `scratch` (rows x cols floats).
const float* rows_f32(const Tensor& t, int64_t r0, int64_t rows, float* scratch);

// An fp32 copy of a (contiguous) tensor, scaled: the tensor itself when fp32 and scale == 1.
Tensor as_f32(const Tensor& t, double scale = 1.0);

// A 64-byte aligned fp32 buffer of n floats (uninitialised).
Tensor scratch_f32(int64_t n);

// What every kernel reads of a call: hidden as fp32 (converted when bf16/fp16), the weight and
// targets contiguous, the bias as fp32 already divided by τ (tiles.cpp).
struct Inputs {
  Inputs(const Tensor& hidden_in, const Tensor& weight_in, const Tensor& targets_in,
         const std::optional<Tensor>& bias_in, double temperature);
  Tensor hidden, weight, targets, bias;
  int64_t N, H, V;
  float inv_t;
  const float* h;
  const float* b;  // nullptr without a bias
  const int64_t* y;
  bool convert_w;  // the weight is bf16/fp16: its tiles are converted to fp32
};

// row_coef of every row from the optional per-row g, g_H and H (tiles.cpp).
std::vector<RowCoef> row_coefs(const Inputs& in, int64_t ignore_index,
                               const std::optional<Tensor>& grad_logp,
                               const std::optional<Tensor>& grad_entropy,
                               const std::optional<Tensor>& entropy);

std::tuple<Tensor, Tensor, Tensor> logprob_fwd_cpu(
    const Tensor& hidden, const Tensor& weight, const Tensor& targets,
    const std::optional<Tensor>& bias, double temperature, int64_t ignore_index,
    bool return_entropy);

std::tuple<Tensor, Tensor, Tensor> logprob_bwd_cpu(
    const Tensor& hidden, const Tensor& weight, const Tensor& targets,
    const std::optional<Tensor>& bias, const Tensor& lse, const std::optional<Tensor>& entropy,
    const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_entropy,
    double temperature, int64_t ignore_index, bool need_hidden, bool need_weight,
    bool need_bias);

// Single pass (logits_chunk.cpp): logits_fwd leaves the chunk's exponentiated logits in
// `logits` [M, buffer_cols(V)] fp32; logits_bwd turns them into dz in place and writes dh
// [M, H] (fp32), and adds to (or, without `accumulate`, writes) dw [V, H] and db [V] (fp32);
// `fold_w`, `fold_b` (an open row's dW and db, docs/math.md §5) add fold_alpha times
// themselves to dw, db in the same vocab sweeps, while each block of dw is in cache.
inline int64_t buffer_cols(int64_t V) { return V + cdiv(V, BLOCK_V); }

std::tuple<Tensor, Tensor, Tensor> logits_fwd_cpu(
    const Tensor& hidden, const Tensor& weight, const Tensor& targets,
    const std::optional<Tensor>& bias, double temperature, int64_t ignore_index,
    bool return_entropy, const Tensor& logits);

void logits_bwd_cpu(const Tensor& logits, const Tensor& hidden, const Tensor& weight,
                    const Tensor& targets, const Tensor& lse, const std::optional<Tensor>& entropy,
                    const std::optional<Tensor>& grad_logp,
                    const std::optional<Tensor>& grad_entropy, double temperature,
                    int64_t ignore_index, const std::optional<Tensor>& dh,
                    const std::optional<Tensor>& dw, const std::optional<Tensor>& db,
                    bool accumulate, const std::optional<Tensor>& fold_w = std::nullopt,
                    const std::optional<Tensor>& fold_b = std::nullopt, double fold_alpha = 1.0);

}  // namespace fgrpo
