// Backward of the fused linear log-prob on CPU: gradients of Σ g·logp + Σ g_H·entropy.
//
//   u = z − lse, p = e^u (z recomputed per tile from the saved lse)
//   dz = (g·(onehot_y − p) − g_H·p·(u + H)) / τ = p·(a + c·u) + onehot_y·g/τ,
//        a = −(g + g_H·H)/τ, c = −g_H/τ      (a = c = 0 on ignored rows: the tile row is 0)
//   dh = dz W,  dW = dz^T h,  db = Σ_n dz
// p = 0 tokens (banned: u = −inf, or far below the max) give dz = 0: u is floored at
// EXP_ZERO_BELOW in the factor (a + c·u), where e^u is already 0.
// Sweeps of SUPER_V vocab entries (outer) x CHUNK_N tokens (inner). Phase 1, one task per token
// block: dz of its BLOCK_N x SUPER_V tile into the [CHUNK_N, SUPER_V] dz buffer, then
// dh += dz W_sweep. Phase 2, one task per fixed SUB_V x SUB_H piece of the sweep:
// dW (+)= dz^T h_chunk and db += Σ_n dz in row order. Every output element has one owner and a
// fixed summation order: bitwise deterministic whatever the thread count.
// An ignored row's dz is 0, but 0·NaN = NaN: a chunk holding an ignored row whose hidden state
// is not finite multiplies dW by a copy of its rows with the ignored ones zeroed.
#include "logprob.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace fgrpo {

std::tuple<Tensor, Tensor, Tensor> logprob_bwd_cpu(
    const Tensor& hidden_in, const Tensor& weight_in, const Tensor& targets_in,
    const std::optional<Tensor>& bias, const Tensor& lse_in, const std::optional<Tensor>& entropy,
    const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_entropy,
    double temperature, int64_t ignore_index, bool need_h, bool need_w, bool need_b) {
  need_b = need_b && bias.has_value();
  const Inputs in(hidden_in, weight_in, targets_in, bias, temperature);
  const Tensor& weight = in.weight;
  const int64_t N = in.N, H = in.H, V = in.V;
  if (N == 0) {
    return {need_h ? at::zeros({N, H}, hidden_in.options()) : at::empty({0}, hidden_in.options()),
            need_w ? at::zeros({V, H}, weight.options()) : at::empty({0}, weight.options()),
            need_b ? at::zeros({V}, bias->options()) : at::empty({0}, at::kFloat)};
  }
  const float inv_t = in.inv_t, *b = in.b, *h = in.h;
  const int64_t* y = in.y;
  const Tensor lse_t = as_f32(lse_in);
  const float* lse = lse_t.const_data_ptr<float>();
  // Per-row coefficients a, c of dz (0 on ignored rows), and g/τ for the target column.
  const std::vector<RowCoef> coef = row_coefs(in, ignore_index, grad_logp, grad_entropy, entropy);

  // Ignored rows with a NaN or inf in their hidden state (see the note at the top).
  std::vector<char> poisoned(need_w ? N : 0, 0);
  for (int64_t n = 0; n < static_cast<int64_t>(poisoned.size()); ++n) {
    if (y[n] != ignore_index) continue;
    const float* row = h + n * H;
    for (int64_t k = 0; k < H && !poisoned[n]; ++k) poisoned[n] = !std::isfinite(row[k]);
  }

  const bool convert_w = in.convert_w;
  const bool direct_dh = hidden_in.scalar_type() == at::kFloat;
  const bool direct_dw = weight.scalar_type() == at::kFloat;
  Tensor dh = need_h ? at::zeros({N, H}, at::kFloat) : at::empty({0}, hidden_in.options());
  Tensor dw = need_w ? at::empty({V, H}, weight.options()) : at::empty({0}, weight.options());
  Tensor db = need_b ? at::empty({V}, at::kFloat) : at::empty({0}, at::kFloat);
  Tensor dz_buf = scratch_f32(std::min(N, CHUNK_N) * SUPER_V);
  Tensor w_buf = scratch_f32(convert_w ? SUPER_V * H : 0);
  Tensor dw_buf = scratch_f32(need_w && !direct_dw ? SUPER_V * H : 0);
  Tensor h_buf;  // the masked copy of a chunk's hidden rows, allocated on first need
  float* dzs = dz_buf.data_ptr<float>();
  float* dhs = need_h ? dh.data_ptr<float>() : nullptr;
  float* dbs = need_b ? db.data_ptr<float>() : nullptr;
  const int64_t h_pieces = need_w ? cdiv(H, SUB_H) : 1;

  for (int64_t s0 = 0; s0 < V; s0 += SUPER_V) {
    const int64_t scols = std::min(SUPER_V, V - s0);
    const float* w = rows_f32(weight, s0, scols, w_buf.data_ptr<float>());
    float* dwt = !need_w ? nullptr
                 : direct_dw ? dw.data_ptr<float>() + s0 * H
                             : dw_buf.data_ptr<float>();
    for (int64_t c0 = 0; c0 < N; c0 += CHUNK_N) {
      const int64_t crows = std::min(CHUNK_N, N - c0);
      // Phase 1: dz of every token block of the chunk, dh += dz W.
      parallel_tasks(cdiv(crows, BLOCK_N), [&](int64_t blk, int) {
        const int64_t n0 = c0 + blk * BLOCK_N, rows = std::min(BLOCK_N, c0 + crows - n0);
        float* dz = dzs + blk * BLOCK_N * SUPER_V;
        // NB: one sgemm over the whole sweep width: wide tiles run sgemm ~15% faster here.
        gemm_nt(rows, scols, H, inv_t, h + n0 * H, H, w, H, 0.f, dz, SUPER_V);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = n0 + r, local = y[n] - s0;
          const bool hit = local >= 0 && local < scols && y[n] != ignore_index;
          dlogits_row(dz + r * SUPER_V, b == nullptr ? nullptr : b + s0, scols, hit ? local : -1,
                      lse[n], coef[n]);
        }
        if (need_h) gemm_nn(rows, H, scols, 1.f, dz, SUPER_V, w, H, 1.f, dhs + n0 * H, H);
      });
      if (!need_w && !need_b) continue;
      const float* hc = h + c0 * H;
      if (need_w && std::any_of(poisoned.begin() + c0, poisoned.begin() + c0 + crows,
                                [](char p) { return p != 0; })) {
        if (!h_buf.defined()) h_buf = scratch_f32(std::min(N, CHUNK_N) * H);
        float* hb = h_buf.data_ptr<float>();
        for (int64_t r = 0; r < crows; ++r) {
          if (poisoned[c0 + r]) {
            std::memset(hb + r * H, 0, sizeof(float) * H);
          } else {
            std::memcpy(hb + r * H, hc + r * H, sizeof(float) * H);
          }
        }
        hc = hb;
      }
      // Phase 2: dW (+)= dz^T h and db += Σ_n dz, one owner per SUB_V x SUB_H piece.
      parallel_tasks(cdiv(scols, SUB_V) * h_pieces, [&](int64_t piece, int) {
        const int64_t r0 = (piece / h_pieces) * SUB_V, k0 = (piece % h_pieces) * SUB_H;
        const int64_t vr = std::min(SUB_V, scols - r0);
        if (need_w) {
          const int64_t cols = std::min(SUB_H, H - k0);
          gemm_tn(vr, cols, crows, 1.f, dzs + r0, SUPER_V, hc + k0, H, c0 == 0 ? 0.f : 1.f,
                  dwt + r0 * H + k0, H);
        }
        if (need_b && k0 == 0) {
          float* acc = dbs + s0 + r0;
          if (c0 == 0) std::memset(acc, 0, sizeof(float) * vr);
          for (int64_t n = 0; n < crows; ++n) {
            const float* dzr = dzs + n * SUPER_V + r0;
            for (int64_t j = 0; j < vr; ++j) acc[j] += dzr[j];
          }
        }
      });
    }
    if (need_w && !direct_dw) {
      dw.narrow(0, s0, scols).copy_(dw_buf.narrow(0, 0, scols * H).view({scols, H}));
    }
  }
  if (need_h && !direct_dh) dh = dh.to(hidden_in.scalar_type());
  if (need_b) db = db.to(bias->scalar_type());
  return {dh, dw, db};
}

}  // namespace fgrpo
