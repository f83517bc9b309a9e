#include "cuda_run.hpp"

#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "flashattn/cuda.hpp"
#include "flashattn/error.hpp"

namespace flashattn::cli {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("--device cuda: ") + what + ": " + cudaGetErrorString(status));
  }
}

std::size_t bytes_of(const ConstTensorView& view) {
  return static_cast<std::size_t>(view.numel()) * dtype_size(view.dtype);
}

// One device allocation the size of a host view, seen through the view's shape and strides
// (contiguous), optionally holding a copy of it.
struct DeviceTensor {
  void* data = nullptr;
  std::size_t bytes = 0;
  TensorView view;

  explicit DeviceTensor(const ConstTensorView& like, bool copy = false) : bytes(bytes_of(like)) {
    check(cudaMalloc(&data, bytes > 0 ? bytes : 1), "cudaMalloc");
    view = {data, like.dtype, like.shape, like.strides};
    if (copy) check(cudaMemcpy(data, like.data, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(data); }

  void copy_to(const TensorView& host) const {
    check(cudaMemcpy(host.data, data, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
};

}  // namespace

struct CudaRun::Device {
  const AttentionOptions& options;
  DeviceTensor q, k, v, out;
  float* lse = nullptr;
  std::size_t lse_bytes = 0;
  std::optional<DeviceTensor> dout, dq, dk, dv;
  cudaStream_t stream = nullptr;

  Device(const ConstTensorView& q_host, const ConstTensorView& k_host,
         const ConstTensorView& v_host, const AttentionOptions& attention)
      : options(attention),
        q(q_host, true),
        k(k_host, true),
        v(v_host, true),
        out(q_host),
        lse_bytes(static_cast<std::size_t>(q_host.shape[0] * q_host.shape[1] * q_host.shape[2]) *
                  sizeof(float)) {
    check(cudaMalloc(reinterpret_cast<void**>(&lse), lse_bytes > 0 ? lse_bytes : 1), "cudaMalloc");
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
  }
  ~Device() {
    cudaStreamDestroy(stream);
    cudaFree(lse);
  }
};

CudaRun::CudaRun(const ConstTensorView& q, const ConstTensorView& k, const ConstTensorView& v,
                 const AttentionOptions& options) {
  if (!cuda::device_available()) {
    throw Error("--device cuda: expected a CUDA device of compute capability 8.0 or later, got " +
                cuda::device_description());
  }
  device_ = std::make_unique<Device>(q, k, v, options);
}

CudaRun::~CudaRun() = default;

void CudaRun::forward() {
  Device& d = *device_;
  cuda::flash_attention_forward(d.q.view, d.k.view, d.v.view, d.out.view, d.lse, d.options,
                                d.stream);
  check(cudaStreamSynchronize(d.stream), "the forward");
}

void CudaRun::copy_forward_out(const TensorView& out, float* lse) const {
  device_->out.copy_to(out);
  check(cudaMemcpy(lse, device_->lse, device_->lse_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
}

void CudaRun::set_dout(const ConstTensorView& dout) {
  Device& d = *device_;
  d.dout.emplace(dout, true);
  d.dq.emplace(d.q.view);
  d.dk.emplace(d.k.view);
  d.dv.emplace(d.v.view);
}

void CudaRun::backward() {
  Device& d = *device_;
  if (!d.dout) throw Error("--device cuda: the backward needs dout (set_dout) first");
  cuda::flash_attention_backward(d.dout->view, d.q.view, d.k.view, d.v.view, d.out.view, d.lse,
                                 d.dq->view, d.dk->view, d.dv->view, d.options, d.stream);
  check(cudaStreamSynchronize(d.stream), "the backward");
}

void CudaRun::copy_gradients(const TensorView& dq, const TensorView& dk,
                             const TensorView& dv) const {
  device_->dq->copy_to(dq);
  device_->dk->copy_to(dk);
  device_->dv->copy_to(dv);
}

}  // namespace flashattn::cli
