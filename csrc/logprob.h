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
#include <cstdint>
#include <optional>
#include <tuple>

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

}  // namespace fgrpo
