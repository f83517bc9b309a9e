#pragma once

// FlashAttention on NVIDIA GPUs (library flashattn::cuda, built with FLASHATTN_CUDA where a CUDA
// toolkit is found). The same views and options as attention.hpp, with device pointers and a
// stream: a separate namespace rather than a device field on TensorView, so that a host pointer
// can never reach a kernel (or a device pointer the CPU paths) by a forgotten field, the CPU API
// stays as it is, and the stream, which every GPU call needs, is an ordinary argument.
//
// Calls are asynchronous on `stream` (null: the legacy default stream), like a CUDA library call:
// the result is there once the stream reaches it. Argument errors raise flashattn::Error before
// anything is queued; a failed launch raises Error with CUDA's message.

#include <string>

#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st*; this header does not need CUDA's.

namespace flashattn::cuda {

using Stream = CUstream_st*;

// Whether a CUDA device of compute capability 8.0 or later (A100, H100, H200, ...) is usable
// from this process: driver and device present.
bool device_available();

// The current device's name, compute capability and multiprocessor count, or why there is none.
std::string device_description();

// FlashAttention forward (FlashAttention-2's scheme on the tensor cores: mma.sync with fp32
// accumulation, K/V tiles double-buffered by cp.async). Shapes, masks, GQA, scale and lse as
// attention.hpp's flash_attention_forward; q, k, v, out and lse are device (or managed) memory.
//   dtype     f16 or bf16 (scores, softmax and the accumulator in fp32; the probability tile
//             rounded to the input dtype as the operand of P·V)
//   head_dim  a multiple of 8 up to 256
//   strides   multiples of 8 elements and 16-byte aligned data (each row moves as 16-byte copies)
// Not on this path yet, and refused with an Error: f32, softcap, ALiBi, sinks, bias, mask.
// options.num_threads is ignored. Long key sequences with few query blocks (decoding) are split
// across multiprocessors and merged exactly (the same (out, lse) merge as merge.hpp).
void flash_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                             const ConstTensorView& v, const TensorView& out, float* lse,
                             const AttentionOptions& options = {}, Stream stream = nullptr);

// FlashAttention backward (FlashAttention-2's scheme: key blocks outermost, P recomputed from
// lse, dK and dV summed in registers). Shapes, masks, GQA and the gradients' meaning as
// backward.hpp's flash_attention_backward; every pointer is device (or managed) memory.
//   dtype     f16 or bf16; P and dS rounded to it as operands of the products, all sums fp32
//   head_dim  a multiple of 8 up to 128
//   strides   as the forward
// dq is summed in fp32 by atomic additions from every key block that its row sees, so its last
// bits may differ from run to run (dk and dv are summed in a fixed order); scratch of
// 4·(head_dim + 1) bytes per query row and head is taken from the stream-ordered allocator.
// Not on this path yet, and refused: f32, score modifiers and their gradients.
void flash_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v,
                              const ConstTensorView& out, const float* lse, const TensorView& dq,
                              const TensorView& dk, const TensorView& dv,
                              const AttentionOptions& options = {}, Stream stream = nullptr);

}  // namespace flashattn::cuda
