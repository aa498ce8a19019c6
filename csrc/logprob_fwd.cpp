// Forward of the fused linear log-prob on CPU.
//
//   z = (h W^T + b) / τ, one BLOCK_N x BLOCK_V tile at a time (sgemm into a cache-resident tile)
//   online over the vocab tiles of a row: m = running max, s = Σ e^(z−m), t = Σ e^(z−m)(z−m)
//   lse = m + log s,  logp = z_y − lse,  entropy = log s − t/s   (0 where y == ignore_index)
// One task per token block; each row is owned by one task, so no cross-thread reduction.
#include "logprob.h"

#include <ATen/ops/empty.h>

namespace fgrpo {

std::tuple<Tensor, Tensor, Tensor> logprob_fwd_cpu(
    const Tensor& hidden_in, const Tensor& weight_in, const Tensor& targets_in,
    const std::optional<Tensor>& bias, double temperature, int64_t ignore_index,
    bool return_entropy) {
  const Inputs in(hidden_in, weight_in, targets_in, bias, temperature);
  const Tensor& weight = in.weight;
  const int64_t N = in.N, H = in.H, V = in.V;
  const float inv_t = in.inv_t, *b = in.b, *h = in.h;
  const int64_t* y = in.y;
  const bool convert_w = in.convert_w;

  Tensor logp = at::empty({N}, at::kFloat), lse = at::empty({N}, at::kFloat);
  Tensor entropy = at::empty({return_entropy ? N : 0}, at::kFloat);
  float* out_logp = logp.data_ptr<float>();
  float* out_lse = lse.data_ptr<float>();
  float* out_ent = return_entropy ? entropy.data_ptr<float>() : nullptr;

  const int64_t blocks = cdiv(N, BLOCK_N);
  const int threads = task_threads(blocks);
  Tensor z_buf = scratch_f32(threads * BLOCK_N * BLOCK_V);
  Tensor w_buf = scratch_f32(convert_w ? threads * BLOCK_V * H : 0);
  float* z_all = z_buf.data_ptr<float>();
  float* w_all = w_buf.data_ptr<float>();
  parallel_tasks(blocks, [&](int64_t blk, int thread) {
    float* z = z_all + thread * BLOCK_N * BLOCK_V;
    float* w_scratch = convert_w ? w_all + thread * BLOCK_V * H : nullptr;
    const int64_t n0 = blk * BLOCK_N, rows = std::min(BLOCK_N, N - n0);
    RowState state[BLOCK_N];
    for (int64_t v0 = 0; v0 < V; v0 += BLOCK_V) {
      const int64_t cols = std::min(BLOCK_V, V - v0);
      const float* w = rows_f32(weight, v0, cols, w_scratch);
      gemm_nt(rows, cols, H, inv_t, h + n0 * H, H, w, H, 0.f, z, BLOCK_V);
      fold_tile(z, BLOCK_V, rows, cols, v0, b, y + n0, return_entropy, state);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      finish_row(state[r], y[n] != ignore_index, out_lse + n, out_logp + n,
                 out_ent != nullptr ? out_ent + n : nullptr);
    }
  });
  return {logp, lse, entropy};
}

}  // namespace fgrpo
