#pragma once

// The MultiHeadAttention layer's matrix steps: projections by OpenBLAS sgemm, their gradients,
// and the checks and allocations of the layer's own buffers. Shared by mha.cpp (forward) and
// mha_backward.cpp.

#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "api/fail.hpp"

namespace flashattn::detail {

// Rows of a [batch·seqlen, H] matrix, or an Error when they overflow the int that CBLAS takes.
std::int64_t matrix_rows(const char* caller, const char* name, std::int64_t batch,
                         std::int64_t seqlen);

// Whether [a, a + a_count) and [b, b + b_count) share an element. Compared as integers: `<` on
// pointers into different arrays is unspecified.
bool overlaps(const float* a, std::int64_t a_count, const float* b, std::int64_t b_count);

// out[rows, n] = in[rows, k] · weight[k, n] + bias[n] (bias may be empty), all row-major.
// The bias is broadcast into `out` first so that one sgemm with beta = 1 adds the product.
void project(float* out, const float* in, std::int64_t rows, std::int64_t k,
             const std::vector<float>& weight, const std::vector<float>& bias, std::int64_t n);

// c[m, n] = op(a)[m, k] · op(b)[k, n] + beta · c, all row-major, op = transpose where asked.
// An empty inner dimension gives beta · c, which BLAS implementations need not write.
void gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc);

// The gradients of out[rows, n] = in[rows, k] · weight[k, n] + bias[n] given d_out:
// d_weight = inᵀ · d_out and, when the layer has biases, d_bias = the column sums of d_out.
void project_backward(std::vector<float>& d_weight, std::vector<float>& d_bias, const float* in,
                      const float* d_out, std::int64_t rows, std::int64_t k, std::int64_t n);

// Runs allocate(), which sizes the layer's own buffers (`floats` floats in all): a failed
// allocation raises Error, as the attention calls' scratch does (docs/robustness.md), not
// std::bad_alloc.
template <class Allocate>
void allocate_or_fail(const char* caller, const char* what, std::int64_t floats,
                      Allocate&& allocate) {
  try {
    allocate();
  } catch (const std::bad_alloc&) {
    fail(caller, "out of memory: could not allocate ", what, " (", floats * 4, " bytes)");
  }
}

// A buffer the next step overwrites entirely, so it is left uninitialized.
inline std::unique_ptr<float[]> scratch(std::int64_t count) {
  return std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(count));
}

}  // namespace flashattn::detail
