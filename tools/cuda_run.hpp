#pragma once

// `flashattn run --device cuda` (built with FLASHATTN_CUDA): the inputs copied to the current GPU
// once, each forward or backward run there and waited for, the results copied back at the end.

#include <memory>

#include "flashattn/attention.hpp"

namespace flashattn::cli {

class CudaRun {
 public:
  // q, k, v: contiguous host views; `options` is kept by reference and must outlive the object.
  CudaRun(const ConstTensorView& q, const ConstTensorView& k, const ConstTensorView& v,
          const AttentionOptions& options);
  ~CudaRun();
  CudaRun(const CudaRun&) = delete;
  CudaRun& operator=(const CudaRun&) = delete;

  // Runs the forward on the GPU and waits for it; argument errors raise flashattn::Error.
  void forward();
  // The last forward's output (a contiguous host view of q's shape and dtype) and lse.
  void copy_forward_out(const TensorView& out, float* lse) const;

  // Copies dO (a contiguous host view shaped as q) to the GPU, for backward().
  void set_dout(const ConstTensorView& dout);
  // Runs the backward of the last forward on the GPU and waits for it.
  void backward();
  // The last backward's gradients, into contiguous host views shaped as q, k and v.
  void copy_gradients(const TensorView& dq, const TensorView& dk, const TensorView& dv) const;

 private:
  struct Device;
  std::unique_ptr<Device> device_;
};

}  // namespace flashattn::cli
