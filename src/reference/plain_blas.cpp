// cblas_sgemm in plain loops, linked instead of OpenBLAS in the sanitizer and fuzz builds
// (FLASHATTN_PLAIN_BLAS). OpenBLAS is not instrumented: AddressSanitizer cannot see its loads
// and stores, so a wrong M, N, K or leading dimension passed by the standard path or the MHA
// layer would read or write outside a buffer unnoticed; ThreadSanitizer cannot see its threads;
// and the Debian OpenMP build of OpenBLAS pulls in libgomp, which must not share a process with
// the LLVM OpenMP runtime that the TSan build uses. Compiled with the sanitizers like the rest,
// this version touches exactly the elements the CBLAS contract allows, so every out-of-bounds
// argument becomes a sanitizer report. Slow on purpose: plain loops, no blocking.

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

[[noreturn]] void bad_argument(const char* name, long long value) {
  // The same reaction as the reference CBLAS's xerbla: report the argument and stop.
  std::fprintf(stderr, "cblas_sgemm (plain): illegal value %lld for %s\n", value, name);
  std::abort();
}

// A row-major matrix, or the transpose of one: element (row, col) of the logical operand.
struct Operand {
  const float* data;
  std::int64_t ld;
  bool transposed;
  float at(std::int64_t row, std::int64_t col) const {
    return transposed ? data[col * ld + row] : data[row * ld + col];
  }
};

// C[M x N] = alpha · op(A)[M x K] · op(B)[K x N] + beta · C, all row-major. C is not read when
// beta is 0 (it may hold NaN or be uninitialized), as the CBLAS contract says.
void sgemm_row_major(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
                     float alpha, const float* A, std::int64_t lda, const float* B,
                     std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  if (M < 0) bad_argument("M", M);
  if (N < 0) bad_argument("N", N);
  if (K < 0) bad_argument("K", K);
  if (lda < std::max<std::int64_t>(1, trans_a ? M : K)) bad_argument("lda", lda);
  if (ldb < std::max<std::int64_t>(1, trans_b ? K : N)) bad_argument("ldb", ldb);
  if (ldc < std::max<std::int64_t>(1, N)) bad_argument("ldc", ldc);
  const Operand a{A, lda, trans_a}, b{B, ldb, trans_b};
  std::vector<float> row(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < M; ++i) {
    // Loop order by the layout of op(B), so that the inner loop walks contiguous memory.
    std::fill(row.begin(), row.end(), 0.0f);
    if (trans_b) {
      for (std::int64_t j = 0; j < N; ++j) {
        for (std::int64_t l = 0; l < K; ++l) row[j] += a.at(i, l) * b.at(l, j);
      }
    } else {
      for (std::int64_t l = 0; l < K; ++l) {
        const float a_il = a.at(i, l);
        for (std::int64_t j = 0; j < N; ++j) row[j] += a_il * b.at(l, j);
      }
    }
    float* c = C + i * ldc;
    for (std::int64_t j = 0; j < N; ++j) {
      c[j] = beta == 0.0f ? alpha * row[j] : alpha * row[j] + beta * c[j];
    }
  }
}

}  // namespace

extern "C" void cblas_sgemm(const enum CBLAS_ORDER Order, const enum CBLAS_TRANSPOSE TransA,
                            const enum CBLAS_TRANSPOSE TransB, const blasint M, const blasint N,
                            const blasint K, const float alpha, const float* A, const blasint lda,
                            const float* B, const blasint ldb, const float beta, float* C,
                            const blasint ldc) {
  const bool trans_a = TransA != CblasNoTrans, trans_b = TransB != CblasNoTrans;
  if (Order == CblasRowMajor) {
    sgemm_row_major(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else {
    // Column-major C = op(A)·op(B) is row-major Cᵀ = op(B)ᵀ·op(A)ᵀ on the same memory.
    sgemm_row_major(trans_b, trans_a, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
  }
}
