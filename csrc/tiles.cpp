// Tile helpers: row-major single-threaded sgemm wrappers, fp32 views of bf16/fp16 rows.
#include "logprob.h"

#include <ATen/ops/empty.h>

#include <algorithm>

// The Fortran BLAS that libtorch links (MKL in the x86 wheels). LP64: tile dimensions and
// leading dimensions are far below 2^31; offsets into the tensors stay int64 in the callers.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);
// MKL's C entry (mkl_service.h maps mkl_set_num_threads_local to it); weak: absent elsewhere.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace fgrpo {
namespace {

// Column-major BLAS on row-major operands: row-major X[r, c] is column-major X^T.
void sgemm_cm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
              int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  const int ia = static_cast<int>(std::max<int64_t>(lda, 1));
  const int ib = static_cast<int>(std::max<int64_t>(ldb, 1));
  const int ic = static_cast<int>(std::max<int64_t>(ldc, 1));
  sgemm_(&ta, &tb, &im, &in, &ik, &alpha, a, &ia, b, &ib, &beta, c, &ic);
}

template <typename T>
void convert_rows(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace

void gemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  sgemm_cm('T', 'N', n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
}

void gemm_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  sgemm_cm('N', 'N', n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
}

void gemm_tn(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  sgemm_cm('N', 'T', n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
}

SerialBlas::SerialBlas()
    : previous(MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0) {}

SerialBlas::~SerialBlas() {
  if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous);
}

const float* rows_f32(const Tensor& t, int64_t r0, int64_t rows, float* scratch) {
  const int64_t cols = t.size(1);
  const int64_t offset = r0 * cols;
  switch (t.scalar_type()) {
    case at::kFloat:
      return t.const_data_ptr<float>() + offset;
    case at::kBFloat16:
      convert_rows(t.const_data_ptr<c10::BFloat16>() + offset, rows * cols, scratch);
      return scratch;
    case at::kHalf:
      convert_rows(t.const_data_ptr<c10::Half>() + offset, rows * cols, scratch);
      return scratch;
    default:
      TORCH_CHECK(false, "fgrpo: expected an fp32, bf16 or fp16 tensor; got ", t.scalar_type());
  }
}

Tensor as_f32(const Tensor& t, double scale) {
  Tensor out = t.scalar_type() == at::kFloat ? t.contiguous() : t.to(at::kFloat).contiguous();
  if (scale != 1.0) out = out.mul(scale);
  return out;
}

Tensor scratch_f32(int64_t n) { return at::empty({std::max<int64_t>(n, 1)}, at::kFloat); }

Inputs::Inputs(const Tensor& hidden_in, const Tensor& weight_in, const Tensor& targets_in,
               const std::optional<Tensor>& bias_in, double temperature)
    : hidden(as_f32(hidden_in)),
      weight(weight_in.contiguous()),
      targets(targets_in.contiguous()),
      N(hidden.size(0)),
      H(hidden.size(1)),
      V(weight.size(0)),
      inv_t(static_cast<float>(1.0 / temperature)) {
  if (bias_in.has_value()) bias = as_f32(*bias_in, inv_t);
  h = hidden.const_data_ptr<float>();
  b = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  y = targets.const_data_ptr<int64_t>();
  convert_w = weight.scalar_type() != at::kFloat;
}

std::vector<RowCoef> row_coefs(const Inputs& in, int64_t ignore_index,
                               const std::optional<Tensor>& grad_logp,
                               const std::optional<Tensor>& grad_entropy,
                               const std::optional<Tensor>& entropy) {
  const bool with_ent = grad_entropy.has_value() && entropy.has_value();
  const Tensor g_t = grad_logp.has_value() ? as_f32(*grad_logp) : Tensor();
  const Tensor gh_t = with_ent ? as_f32(*grad_entropy) : Tensor();
  const Tensor ent_t = with_ent ? as_f32(*entropy) : Tensor();
  std::vector<RowCoef> coef(in.N);
  for (int64_t n = 0; n < in.N; ++n) {
    const bool valid = in.y[n] != ignore_index;
    coef[n] = row_coef(valid, valid && g_t.defined() ? g_t.const_data_ptr<float>()[n] : 0.f,
                       valid && with_ent ? gh_t.const_data_ptr<float>()[n] : 0.f,
                       valid && with_ent ? ent_t.const_data_ptr<float>()[n] : 0.f, in.inv_t);
  }
  return coef;
}

}  // namespace fgrpo
