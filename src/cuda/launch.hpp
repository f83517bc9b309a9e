#pragma once

// The kernels' host entry (flash_forward_sm80.cu), called by cuda_api.cpp once the call is
// validated and its split-KV workspace allocated.

#include <cuda_runtime_api.h>

#include "cuda/kernel_params.hpp"

namespace flashattn::cuda::detail {

// Query rows per thread block, and keys per block for a head_dim: the tiles the kernels use, for
// the host's grid and split sizes.
int forward_block_m();
int forward_block_n(int head_dim);

// Queues the forward (and, with p.num_splits > 1, the merge of the splits) on `stream`; returns
// the launch's error.
cudaError_t launch_flash_forward(const ForwardParams& p, cudaStream_t stream);

// Queues the backward's three launches (D, the key blocks, dq) on `stream`; b.dq_sum must be
// zeroed on the stream before. Returns the launches' error.
cudaError_t launch_flash_backward(const BackwardParams& b, cudaStream_t stream);

}  // namespace flashattn::cuda::detail
