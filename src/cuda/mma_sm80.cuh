#pragma once

// The pieces of sm80 tensor-core code that the forward and the backward kernels share: the 16-bit
// element types with their mma.sync, 16-byte asynchronous copies into swizzled shared-memory
// tiles, ldmatrix, and the reductions over the 4 lanes that hold one row of an mma accumulator.
// Every kernel here runs 4 warps (kThreads).
//
// mma.sync m16n8k16 fragments (lane = 4·group + in_group): A (16x16, row-major) is 4 registers
// of 2 elements: rows group and group + 8, columns 2·in_group (+1) and + 8; B (16x8) is 2
// registers: rows (k) 2·in_group (+1) and + 8, column (n) group; the fp32 accumulator C (16x8) is
// rows group (c0, c1) and group + 8 (c2, c3), columns 2·in_group and + 1.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "cuda/kernel_params.hpp"

namespace flashattn::cuda::detail {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// ---- element types ---------------------------------------------------------------------------

template <Element E>
struct ElementTraits;

template <>
struct ElementTraits<Element::f16> {
  using Scalar = __half;
  __device__ static Scalar from_float(float x) { return __float2half_rn(x); }
  // Two floats as one 32-bit register of two halves, the first in the low half (the element of
  // the lower column in an mma fragment).
  __device__ static std::uint32_t pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
  __device__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                             std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct ElementTraits<Element::bf16> {
  using Scalar = __nv_bfloat16;
  __device__ static Scalar from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static std::uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
  __device__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                             std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ---- shared memory and copies ----------------------------------------------------------------

// Element offset of (row, column) in a swizzled tile of kColumns 16-bit columns: 16-byte chunk c
// of a row is stored at chunk c ^ (row % 8), so that ldmatrix's 8 row addresses (8 consecutive
// rows, one chunk each) fall in 8 different 16-byte bank groups. Rows of 4 chunks (32 columns,
// two rows per 128 bytes) use c ^ (row / 2 % 4) for the same effect.
template <int kColumns>
__device__ __forceinline__ int swizzled(int row, int column) {
  constexpr int kChunks = kColumns / 8;
  static_assert(kChunks == 4 || kChunks % 8 == 0, "rows of 32 columns or a multiple of 64");
  const int pattern = kChunks == 4 ? (row >> 1) & 3 : row & 7;
  return row * kColumns + ((column >> 3) ^ pattern) * 8 + (column & 7);
}

__device__ __forceinline__ std::uint32_t shared_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes from global to shared memory, asynchronously; `bytes` 0 writes 16 zero bytes and reads
// nothing.
__device__ __forceinline__ void copy_16_async(std::uint32_t destination, const void* source,
                                              int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(source),
               "r"(bytes));
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Rows [first_row, first_row + kRows) of a [seq, head_dim] slice (row stride `row_stride`
// elements) into a swizzled tile; rows at or past `rows` and columns at or past `head_dim` are
// zero-filled.
template <int kHeadDim, int kRows, class Scalar>
__device__ __forceinline__ void load_tile(Scalar* tile, const Scalar* source,
                                          std::int64_t row_stride, std::int64_t first_row,
                                          std::int64_t rows, int head_dim) {
  constexpr int kChunks = kHeadDim / 8;
  for (int index = threadIdx.x; index < kRows * kChunks; index += kThreads) {
    const int row = index / kChunks, chunk = index % kChunks;
    const bool inside = first_row + row < rows && chunk * 8 < head_dim;
    const Scalar* from = inside ? source + (first_row + row) * row_stride + chunk * 8 : source;
    copy_16_async(shared_address(tile + swizzled<kHeadDim>(row, chunk * 8)), from, inside ? 16 : 0);
  }
}

// Four 8x8 matrices of 16-bit elements from shared memory; lane l gives the address of row
// l % 8 of matrix l / 8. Without .trans, register i holds matrix i's row lane/4, columns
// 2·(lane%4) and +1; with .trans the same of the transposed matrix.
__device__ __forceinline__ void load_matrices(std::uint32_t (&r)[4], std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void load_matrices_transposed(std::uint32_t (&r)[4],
                                                         std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The row maximum and sum of the 4 lanes that share a row in an mma accumulator.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

constexpr float kMinusInf = -INFINITY;
constexpr float kLn2 = 0.693147180559945309f;

}  // namespace
}  // namespace flashattn::cuda::detail
