// Single pass of the fused linear log-prob on CPU: one chunk of rows whose logits, once
// exponentiated, stay in a buffer between the log-sum-exp and the gradient (docs/math.md §5,
// "Single pass").
//
//   logits_fwd: z = (h W^T + b)/τ, one BLOCK_N x BLOCK_V tile at a time into the buffer, folded
//     into the online (m, s, t) of its rows while in cache, and left there as e = e^(z − m_t)
//     with the tile's reference m_t beside the row (the target's column keeps z_y) → lse, logp,
//     entropy. Tasks: (token block, vocab split of SPLIT_V); the splits merge in split order.
//   logits_bwd: p = e·e^(m_t − lse) (one product per entry where the two-pass backward takes
//     an exp; u = log e + m_t − lse only for an entropy gradient), dz in place by the rule of
//     logprob_bwd.cpp, dh = dz W, dW (+)= dz^T h, db (+)= Σ_n dz. One task per lane, a fixed
//     run of SWEEP_V-wide vocab sweeps: each sweep's dz tile is formed and fed to both products
//     while in cache; the lanes' dh partials add up in lane order. An open row's dW and db
//     (fold_w, fold_b) join dW, db in the same sweeps, each block while it is in cache.
// Buffer rows: V entries, then cdiv(V, BLOCK_V) tile references (`buffer_cols`). Three
// GEMM-sized passes over the chunk (z, dh, dW) where the two-pass path takes four (it
// recomputes z). Every output element has one owner and a fixed summation order: bitwise the
// same whatever the thread count.
#include "logprob.h"

#include <ATen/ops/empty.h>

#include <vector>

namespace fgrpo {
namespace {

constexpr int64_t SPLIT_V = 8192;  // vocab entries per forward task
constexpr int64_t SWEEP_V = 512;   // vocab entries per backward sweep (the dz tile's width)
constexpr int64_t LANES = 4;       // backward tasks (fixed: the dh partials' order is fixed)
static_assert(SPLIT_V % BLOCK_V == 0 && BLOCK_V % SWEEP_V == 0, "a sweep lies in one tile");

// dz of one row segment in place from e = e^(z − m_t) (one tile's reference m_t; the target's
// entry, at `local` or −1, holds z_y): p = e·e^(m_t − lse), dz = p·(a + c·u) + onehot·gy.
void dlogits_from_exp(float* er, int64_t cols, int64_t local, float m_t, float lse, RowCoef k) {
  if (k.a == 0.f && k.c == 0.f && k.gy == 0.f) {
    std::memset(er, 0, sizeof(float) * cols);
    return;
  }
  const float u_y = local >= 0 ? er[local] - lse : 0.f;
  const float shift = m_t - lse, f = std::exp(shift);
  constexpr int64_t W = Vec::size();
  const int64_t vec_end = cols - cols % W;
  if (k.c == 0.f) {
    const Vec va(f * k.a);
    for (int64_t j = 0; j < vec_end; j += W) (Vec::loadu(er + j) * va).store(er + j);
    for (int64_t j = vec_end; j < cols; ++j) er[j] *= f * k.a;
  } else {
    // u = log e + shift, floored where e^u is 0 in fp32 (log 0 = −inf)
    const Vec vf(f), vs(shift), va(k.a), vc(k.c), vfloor(EXP_ZERO_BELOW);
    for (int64_t j = 0; j < vec_end; j += W) {
      const Vec e = Vec::loadu(er + j);
      const Vec u = at::vec::maximum(e.log() + vs, vfloor);
      (e * vf * at::vec::fmadd(vc, u, va)).store(er + j);
    }
    for (int64_t j = vec_end; j < cols; ++j) {
      const float u = std::max(std::log(er[j]) + shift, EXP_ZERO_BELOW);
      er[j] = er[j] * f * (k.a + k.c * u);
    }
  }
  // NB: as in dlogits_row: the target's g·(1 − p_y)/τ as −(g/τ)·expm1(u_y), from z_y itself.
  if (local >= 0) {
    const float u_lin = std::max(u_y, EXP_ZERO_BELOW);
    er[local] = -k.gy * std::expm1(u_y) + std::exp(u_y) * (k.a + k.gy + k.c * u_lin);
  }
}

// dst = (accumulate ? dst : 0) + alpha·src over n entries (src null: dst kept, or zeroed
// without `accumulate`): an open row's dW or db folded in (docs/math.md §5).
void fold_block(float* dst, const float* src, int64_t n, float alpha, bool accumulate) {
  if (src == nullptr) {
    if (!accumulate) std::memset(dst, 0, sizeof(float) * n);
    return;
  }
  constexpr int64_t W = Vec::size();
  const int64_t vec_end = n - n % W;
  const Vec va(alpha);
  if (accumulate) {
    for (int64_t j = 0; j < vec_end; j += W) {
      at::vec::fmadd(va, Vec::loadu(src + j), Vec::loadu(dst + j)).store(dst + j);
    }
    for (int64_t j = vec_end; j < n; ++j) dst[j] += alpha * src[j];
  } else {
    for (int64_t j = 0; j < vec_end; j += W) (va * Vec::loadu(src + j)).store(dst + j);
    for (int64_t j = vec_end; j < n; ++j) dst[j] = alpha * src[j];
  }
}

// Merges the state of a later vocab split into `a` (the combine rule of the online LSE).
void merge_state(RowState& a, const RowState& b) {
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  const float m = std::max(a.m, b.m);
  a.z_y += b.z_y;
  if (m == NEG_INF) return;
  const float da = a.m == NEG_INF ? 0.f : a.m - m, db = b.m == NEG_INF ? 0.f : b.m - m;
  const float sa = a.m == NEG_INF ? 0.f : std::exp(da), sb = b.m == NEG_INF ? 0.f : std::exp(db);
  a.t = sa * (a.t + da * a.s) + sb * (b.t + db * b.s);
  a.s = sa * a.s + sb * b.s;
  a.m = m;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> logits_fwd_cpu(
    const Tensor& hidden_in, const Tensor& weight_in, const Tensor& targets_in,
    const std::optional<Tensor>& bias, double temperature, int64_t ignore_index,
    bool return_entropy, const Tensor& logits) {
  const Inputs in(hidden_in, weight_in, targets_in, bias, temperature);
  const Tensor& weight = in.weight;
  const int64_t M = in.N, H = in.H, V = in.V;
  const float inv_t = in.inv_t, *b = in.b, *h = in.h;
  const int64_t* y = in.y;
  const bool convert_w = in.convert_w;
  float* z_all = logits.data_ptr<float>();
  const int64_t LD = buffer_cols(V);

  Tensor logp = at::empty({M}, at::kFloat), lse = at::empty({M}, at::kFloat);
  Tensor entropy = at::empty({return_entropy ? M : 0}, at::kFloat);
  const int64_t blocks = cdiv(M, BLOCK_N), splits = cdiv(V, SPLIT_V);
  std::vector<RowState> part(splits * M);
  const int threads = task_threads(blocks * splits);
  Tensor w_buf = scratch_f32(convert_w ? threads * BLOCK_V * H : 0);
  float* w_all = w_buf.data_ptr<float>();
  parallel_tasks(blocks * splits, [&](int64_t task, int thread) {
    const int64_t blk = task / splits, split = task % splits;
    const int64_t n0 = blk * BLOCK_N, rows = std::min(BLOCK_N, M - n0);
    const int64_t v_end = std::min(V, (split + 1) * SPLIT_V);
    float* w_scratch = convert_w ? w_all + thread * BLOCK_V * H : nullptr;
    RowState* state = part.data() + split * M + n0;
    for (int64_t v0 = split * SPLIT_V; v0 < v_end; v0 += BLOCK_V) {
      const int64_t cols = std::min(BLOCK_V, v_end - v0);
      const float* w = rows_f32(weight, v0, cols, w_scratch);
      float* z = z_all + n0 * LD + v0;
      gemm_nt(rows, cols, H, inv_t, h + n0 * H, H, w, H, 0.f, z, LD);
      fold_tile(z, LD, rows, cols, v0, b, y + n0, return_entropy, state,
                z_all + n0 * LD + V + v0 / BLOCK_V, LD);
    }
  });
  float* out_ent = return_entropy ? entropy.data_ptr<float>() : nullptr;
  for (int64_t n = 0; n < M; ++n) {
    RowState st = part[n];
    for (int64_t k = 1; k < splits; ++k) merge_state(st, part[k * M + n]);
    finish_row(st, y[n] != ignore_index, lse.data_ptr<float>() + n, logp.data_ptr<float>() + n,
               out_ent != nullptr ? out_ent + n : nullptr);
  }
  return {logp, lse, entropy};
}

void logits_bwd_cpu(const Tensor& logits, const Tensor& hidden_in, const Tensor& weight_in,
                    const Tensor& targets_in, const Tensor& lse_in,
                    const std::optional<Tensor>& entropy, const std::optional<Tensor>& grad_logp,
                    const std::optional<Tensor>& grad_entropy, double temperature,
                    int64_t ignore_index, const std::optional<Tensor>& dh,
                    const std::optional<Tensor>& dw, const std::optional<Tensor>& db,
                    bool accumulate, const std::optional<Tensor>& fold_w,
                    const std::optional<Tensor>& fold_b, double fold_alpha) {
  const bool need_h = dh.has_value(), need_w = dw.has_value(), need_b = db.has_value();
  const Inputs in(hidden_in, weight_in, targets_in, std::nullopt, temperature);
  const Tensor& weight = in.weight;
  const int64_t M = in.N, H = in.H, V = in.V;
  const float* fws = fold_w.has_value() ? fold_w->const_data_ptr<float>() : nullptr;
  const float* fbs = fold_b.has_value() ? fold_b->const_data_ptr<float>() : nullptr;
  const float alpha = static_cast<float>(fold_alpha);
  if (M == 0) {
    if (need_w) fold_block(dw->data_ptr<float>(), fws, V * H, alpha, accumulate);
    if (need_b) fold_block(db->data_ptr<float>(), fbs, V, alpha, accumulate);
    return;
  }
  const int64_t* y = in.y;
  const Tensor lse_t = as_f32(lse_in);
  const float* lse = lse_t.const_data_ptr<float>();
  const std::vector<RowCoef> coef = row_coefs(in, ignore_index, grad_logp, grad_entropy, entropy);
  const bool any_ignored = std::any_of(y, y + M, [&](int64_t t) { return t == ignore_index; });
  // dW's hidden operand: ignored rows set to 0, not multiplied by their 0 rows of dz (NaN·0).
  Tensor hidden = in.hidden;
  if (need_w && any_ignored) {
    hidden = hidden.clone();
    float* hm = hidden.data_ptr<float>();
    for (int64_t n = 0; n < M; ++n) {
      if (y[n] == ignore_index) std::memset(hm + n * H, 0, sizeof(float) * H);
    }
  }
  const float* h = hidden.const_data_ptr<float>();

  float* z_all = logits.data_ptr<float>();
  const int64_t LD = buffer_cols(V);
  const int64_t sweeps = cdiv(V, SWEEP_V), lanes = std::min(LANES, sweeps);
  const bool convert_w = in.convert_w;
  Tensor parts = scratch_f32(need_h ? (lanes - 1) * M * H : 0);
  Tensor w_buf = scratch_f32(convert_w ? lanes * SWEEP_V * H : 0);
  float* dhs = need_h ? dh->data_ptr<float>() : nullptr;
  float* dws = need_w ? dw->data_ptr<float>() : nullptr;
  float* dbs = need_b ? db->data_ptr<float>() : nullptr;
  parallel_tasks(lanes, [&](int64_t lane, int) {
    float* w_scratch = convert_w ? w_buf.data_ptr<float>() + lane * SWEEP_V * H : nullptr;
    float* dh_part = lane == 0 ? dhs : parts.data_ptr<float>() + (lane - 1) * M * H;
    const int64_t s_begin = lane * sweeps / lanes, s_end = (lane + 1) * sweeps / lanes;
    for (int64_t s = s_begin; s < s_end; ++s) {
      const int64_t s0 = s * SWEEP_V, cols = std::min(SWEEP_V, V - s0);
      float* z = z_all + s0;
      for (int64_t r = 0; r < M; ++r) {
        const int64_t local = y[r] - s0;
        const bool hit = local >= 0 && local < cols && y[r] != ignore_index;
        const float m_t = z_all[r * LD + V + s0 / BLOCK_V];
        dlogits_from_exp(z + r * LD, cols, hit ? local : -1, m_t, lse[r], coef[r]);
      }
      if (need_h) {
        const float* w = rows_f32(weight, s0, cols, w_scratch);
        gemm_nn(M, H, cols, 1.f, z, LD, w, H, s == s_begin ? 0.f : 1.f, dh_part, H);
      }
      if (need_w) {
        // the fold's block of dW, then the chunk's terms on it while it is in cache
        float* dwb = dws + s0 * H;
        if (fws != nullptr) fold_block(dwb, fws + s0 * H, cols * H, alpha, accumulate);
        const float beta = accumulate || fws != nullptr ? 1.f : 0.f;
        gemm_tn(cols, H, M, 1.f, z, LD, h, H, beta, dwb, H);
      }
      if (need_b) {
        float* acc = dbs + s0;
        fold_block(acc, fbs == nullptr ? nullptr : fbs + s0, cols, alpha, accumulate);
        for (int64_t r = 0; r < M; ++r) {
          const float* dzr = z + r * LD;
          for (int64_t j = 0; j < cols; ++j) acc[j] += dzr[j];
        }
      }
    }
  });
  if (need_h) {
    for (int64_t lane = 1; lane < lanes; ++lane) {
      const float* p = parts.data_ptr<float>() + (lane - 1) * M * H;
      for (int64_t i = 0; i < M * H; ++i) dhs[i] += p[i];
    }
  }
}

}  // namespace fgrpo
