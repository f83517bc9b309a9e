#pragma once

// The forward of `flashattn run --device cuda` (built with FLASHATTN_CUDA): the inputs copied to
// the current GPU once, each call run there and waited for, the results copied back at the end.

#include <memory>

#include "flashattn/attention.hpp"

namespace flashattn::cli {

class CudaForwardRun {
 public:
  // q, k, v: contiguous host views; `options` is kept by reference and must outlive the object.
  CudaForwardRun(const ConstTensorView& q, const ConstTensorView& k, const ConstTensorView& v,
                 const AttentionOptions& options);
  ~CudaForwardRun();
  CudaForwardRun(const CudaForwardRun&) = delete;
  CudaForwardRun& operator=(const CudaForwardRun&) = delete;

  // Runs the forward on the GPU and waits for it; argument errors raise flashattn::Error.
  void operator()();
  // The last run's output (contiguous host view of q's shape and dtype) and lse (host floats).
  void copy_out(const TensorView& out, float* lse) const;

 private:
  struct Device;
  std::unique_ptr<Device> device_;
};

}  // namespace flashattn::cli
