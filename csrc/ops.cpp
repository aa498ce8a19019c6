// The custom ops torch.ops.fgrpo.logprob_fwd / logprob_bwd and the single pass's logits_fwd /
// logits_bwd (CPU kernels; the fake kernels that torch.compile traces live in
// fgrpo_kernels/cpu/cpp.py). Checks here guard direct callers
// (ValueError / TypeError naming the argument); the public function validates its arguments
// before reaching them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "logprob.h"

namespace fgrpo {
namespace {

bool float_family(const Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

// The one place that fixes which target ids are valid: [0, vocab_total) or ignore_index, where
// this weight holds the rows [vocab_start, vocab_start + V) of the vocabulary (the whole of it by
// default; one shard of it under vocabulary parallelism). O(N), next to O(N·V·H) of work.
void check_targets_in_vocab(const Tensor& targets, int64_t ignore_index, int64_t vocab_total) {
  const Tensor y_t = targets.contiguous();
  const int64_t* y = y_t.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < y_t.numel(); ++n) {
    TORCH_CHECK_VALUE(y[n] == ignore_index || (y[n] >= 0 && y[n] < vocab_total),
                      "targets: expected ids in [0, ", vocab_total, ") or ignore_index=",
                      ignore_index, "; got ", y[n], " at position ", n);
  }
}

// Global target ids → ids of this shard's rows; a target owned by another shard becomes a
// sentinel that matches no column (and is not ignore_index), so its row still gets its lse,
// entropy and −p gradient here. The identity for the whole vocabulary.
Tensor local_targets(const Tensor& targets, int64_t ignore_index, int64_t vocab_start,
                     int64_t vocab_total, int64_t vocab) {
  if (vocab_start == 0 && (vocab_total < 0 || vocab_total == vocab)) return targets;
  const int64_t sentinel = ignore_index != -1 ? -1 : -2;
  const Tensor local = targets - vocab_start;
  const Tensor owned =
      local.ge(0).logical_and(local.lt(vocab)).logical_and(targets.ne(ignore_index));
  const Tensor other = at::full_like(targets, sentinel).masked_fill(targets.eq(ignore_index),
                                                                    ignore_index);
  return at::where(owned, local, other);
}

void check_inputs(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                  const std::optional<Tensor>& bias, double temperature, int64_t ignore_index,
                  int64_t vocab_start, int64_t vocab_total) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "hidden: expected shape [N, H]; got ", hidden.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == hidden.size(1),
                    "weight: expected shape [V, ", hidden.size(1), "]; got ", weight.sizes());
  TORCH_CHECK_VALUE(targets.dim() == 1 && targets.size(0) == hidden.size(0),
                    "targets: expected shape [", hidden.size(0), "]; got ", targets.sizes());
  TORCH_CHECK_TYPE(targets.scalar_type() == at::kLong, "targets: expected int64; got ",
                   targets.scalar_type());
  TORCH_CHECK_TYPE(float_family(hidden) && float_family(weight),
                   "hidden, weight: expected fp32, bf16 or fp16; got ", hidden.scalar_type(),
                   ", ", weight.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "bias: expected shape [", weight.size(0), "]; got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->is_floating_point(), "bias: expected a floating tensor");
  }
  TORCH_CHECK_VALUE(temperature > 0, "temperature: expected > 0; got ", temperature);
  const int64_t V = weight.size(0);
  TORCH_CHECK_VALUE(vocab_start >= 0 && (vocab_total < 0 || vocab_start + V <= vocab_total),
                    "vocab_start: expected the rows [vocab_start, vocab_start + ", V,
                    ") inside [0, vocab_total=", vocab_total, "); got vocab_start=", vocab_start);
  check_targets_in_vocab(targets, ignore_index, vocab_total < 0 ? V : vocab_total);
}

std::tuple<Tensor, Tensor, Tensor> fwd(const Tensor& hidden, const Tensor& weight,
                                       const Tensor& targets, const std::optional<Tensor>& bias,
                                       double temperature, int64_t ignore_index,
                                       bool return_entropy, int64_t vocab_start,
                                       int64_t vocab_total) {
  check_inputs(hidden, weight, targets, bias, temperature, ignore_index, vocab_start, vocab_total);
  const Tensor y = local_targets(targets, ignore_index, vocab_start, vocab_total, weight.size(0));
  return logprob_fwd_cpu(hidden, weight, y, bias, temperature, ignore_index, return_entropy);
}

std::tuple<Tensor, Tensor, Tensor> bwd(
    const Tensor& hidden, const Tensor& weight, const Tensor& targets,
    const std::optional<Tensor>& bias, const Tensor& lse, const std::optional<Tensor>& entropy,
    const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_entropy,
    double temperature, int64_t ignore_index, bool need_hidden, bool need_weight,
    bool need_bias, int64_t vocab_start, int64_t vocab_total) {
  check_inputs(hidden, weight, targets, bias, temperature, ignore_index, vocab_start, vocab_total);
  const Tensor y = local_targets(targets, ignore_index, vocab_start, vocab_total, weight.size(0));
  const int64_t N = hidden.size(0);
  TORCH_CHECK_VALUE(lse.numel() == N, "lse: expected ", N, " values; got ", lse.numel());
  for (const auto* t : {&entropy, &grad_logp, &grad_entropy}) {
    TORCH_CHECK_VALUE(!t->has_value() || (*t)->numel() == N,
                "entropy, grad_logp, grad_entropy: expected ", N, " values each");
  }
  return logprob_bwd_cpu(hidden, weight, y, bias, lse, entropy, grad_logp, grad_entropy,
                         temperature, ignore_index, need_hidden, need_weight, need_bias);
}

void check_f32(const char* name, const Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.sizes() == shape, name, ": expected shape ", shape, "; got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat && t.is_contiguous(), name,
                   ": expected a contiguous fp32 tensor; got ", t.scalar_type());
}

std::tuple<Tensor, Tensor, Tensor> chunk_fwd(const Tensor& hidden, const Tensor& weight,
                                             const Tensor& targets,
                                             const std::optional<Tensor>& bias,
                                             double temperature, int64_t ignore_index,
                                             bool return_entropy, const Tensor& logits) {
  check_inputs(hidden, weight, targets, bias, temperature, ignore_index, 0, -1);
  check_f32("logits", logits, {hidden.size(0), buffer_cols(weight.size(0))});
  return logits_fwd_cpu(hidden, weight, targets, bias, temperature, ignore_index, return_entropy,
                        logits);
}

void chunk_bwd(const Tensor& logits, const Tensor& hidden, const Tensor& weight,
               const Tensor& targets, const std::optional<Tensor>& bias, const Tensor& lse,
               const std::optional<Tensor>& entropy, const std::optional<Tensor>& grad_logp,
               const std::optional<Tensor>& grad_entropy, double temperature,
               int64_t ignore_index, const std::optional<Tensor>& dh,
               const std::optional<Tensor>& dw, const std::optional<Tensor>& db,
               bool accumulate, const std::optional<Tensor>& fold_w,
               const std::optional<Tensor>& fold_b, double fold_alpha) {
  check_inputs(hidden, weight, targets, bias, temperature, ignore_index, 0, -1);
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  check_f32("logits", logits, {N, buffer_cols(V)});
  TORCH_CHECK_VALUE(lse.numel() == N, "lse: expected ", N, " values; got ", lse.numel());
  for (const auto* t : {&entropy, &grad_logp, &grad_entropy}) {
    TORCH_CHECK_VALUE(!t->has_value() || (*t)->numel() == N,
                      "entropy, grad_logp, grad_entropy: expected ", N, " values each");
  }
  if (dh.has_value()) check_f32("dh", *dh, {N, H});
  if (dw.has_value()) check_f32("dw", *dw, {V, H});
  if (db.has_value()) check_f32("db", *db, {V});
  TORCH_CHECK_VALUE(!fold_w.has_value() || dw.has_value(), "fold_w: given without dw");
  TORCH_CHECK_VALUE(!fold_b.has_value() || db.has_value(), "fold_b: given without db");
  if (fold_w.has_value()) check_f32("fold_w", *fold_w, {V, H});
  if (fold_b.has_value()) check_f32("fold_b", *fold_b, {V});
  logits_bwd_cpu(logits, hidden, weight, targets, lse, entropy, grad_logp, grad_entropy,
                 temperature, ignore_index, dh, dw, db, accumulate, fold_w, fold_b,
                 fold_alpha);
}

}  // namespace
}  // namespace fgrpo

TORCH_LIBRARY(fgrpo, m) {
  m.def(
      "logprob_fwd(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, "
      "float temperature, int ignore_index, bool return_entropy, int vocab_start=0, "
      "int vocab_total=-1) -> (Tensor, Tensor, Tensor)");
  m.def(
      "logprob_bwd(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, Tensor lse, "
      "Tensor? entropy, Tensor? grad_logp, Tensor? grad_entropy, float temperature, "
      "int ignore_index, bool need_hidden, bool need_weight, bool need_bias, "
      "int vocab_start=0, int vocab_total=-1) -> (Tensor, Tensor, Tensor)");
  m.def(
      "logits_fwd(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, "
      "float temperature, int ignore_index, bool return_entropy, Tensor(a!) logits) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "logits_bwd(Tensor(a!) logits, Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, "
      "Tensor lse, Tensor? entropy, Tensor? grad_logp, Tensor? grad_entropy, float temperature, "
      "int ignore_index, Tensor(b!)? dh, Tensor(c!)? dw, Tensor(d!)? db, bool accumulate, "
      "Tensor? fold_w=None, Tensor? fold_b=None, float fold_alpha=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(fgrpo, CPU, m) {
  m.impl("logprob_fwd", &fgrpo::fwd);
  m.impl("logprob_bwd", &fgrpo::bwd);
  m.impl("logits_fwd", &fgrpo::chunk_fwd);
  m.impl("logits_bwd", &fgrpo::chunk_bwd);
}
