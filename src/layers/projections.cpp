#include "layers/projections.hpp"

#include <cblas.h>

#include <algorithm>
#include <mutex>

#include "util/blas_lock.hpp"

namespace flashattn::detail {

// Rows of a [batch·seqlen, H] matrix, or an Error when they overflow the int that CBLAS takes.
std::int64_t matrix_rows(const char* caller, const char* name, std::int64_t batch,
                         std::int64_t seqlen) {
  std::int64_t rows = 0;
  if (__builtin_mul_overflow(batch, seqlen, &rows) || rows > INT32_MAX) {
    fail(caller, name, ": expected batch * seqlen <= ", INT32_MAX, " (a CBLAS int), got ", batch,
         " * ", seqlen);
  }
  return rows;
}

// Whether [a, a + a_count) and [b, b + b_count) share an element. Compared as integers: `<` on
// pointers into different arrays is unspecified.
bool overlaps(const float* a, std::int64_t a_count, const float* b, std::int64_t b_count) {
  const auto a_begin = reinterpret_cast<std::uintptr_t>(a);
  const auto b_begin = reinterpret_cast<std::uintptr_t>(b);
  const auto a_end = a_begin + static_cast<std::uintptr_t>(a_count) * sizeof(float);
  const auto b_end = b_begin + static_cast<std::uintptr_t>(b_count) * sizeof(float);
  return a_count > 0 && b_count > 0 && a_begin < b_end && b_begin < a_end;
}

// out[rows, n] = in[rows, k] · weight[k, n] + bias[n] (bias may be empty), all row-major.
// The bias is broadcast into `out` first so that one sgemm with beta = 1 adds the product.
void project(float* out, const float* in, std::int64_t rows, std::int64_t k,
             const std::vector<float>& weight, const std::vector<float>& bias, std::int64_t n) {
  if (rows == 0) return;
  float beta = 0.0f;
  if (!bias.empty()) {
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy(bias.begin(), bias.end(), out + r * n);
    }
    beta = 1.0f;
  }
  const std::lock_guard blas_lock(detail::blas_mutex());
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
              static_cast<int>(n), static_cast<int>(k), 1.0f, in, static_cast<int>(k),
              weight.data(), static_cast<int>(n), beta, out, static_cast<int>(n));
}

// c[m, n] = op(a)[m, k] · op(b)[k, n] + beta · c, all row-major, op = transpose where asked.
// An empty inner dimension gives beta · c, which BLAS implementations need not write.
void gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0f) {
      for (std::int64_t r = 0; r < m; ++r) std::fill_n(c + r * ldc, n, 0.0f);
    }
    return;
  }
  const std::lock_guard blas_lock(detail::blas_mutex());
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

// The gradients of out[rows, n] = in[rows, k] · weight[k, n] + bias[n] given d_out:
// d_weight = inᵀ · d_out and, when the layer has biases, d_bias = the column sums of d_out.
void project_backward(std::vector<float>& d_weight, std::vector<float>& d_bias, const float* in,
                      const float* d_out, std::int64_t rows, std::int64_t k, std::int64_t n) {
  gemm(true, false, k, n, rows, in, k, d_out, n, 0.0f, d_weight.data(), n);
  if (d_bias.empty()) return;
  std::fill(d_bias.begin(), d_bias.end(), 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < n; ++c) d_bias[c] += d_out[r * n + c];
  }
}

}  // namespace flashattn::detail
