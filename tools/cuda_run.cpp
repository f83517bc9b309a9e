#include "cuda_run.hpp"

#include <cuda_runtime_api.h>

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

// One device allocation holding a copy of a host view (or room for one).
struct DeviceTensor {
  void* data = nullptr;
  std::size_t bytes = 0;
  DeviceTensor() = default;
  explicit DeviceTensor(std::size_t size) : bytes(size) {
    check(cudaMalloc(&data, bytes > 0 ? bytes : 1), "cudaMalloc");
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(data); }
};

}  // namespace

struct CudaForwardRun::Device {
  const AttentionOptions& options;
  ConstTensorView q, k, v;
  TensorView out;
  DeviceTensor q_data, k_data, v_data, out_data, lse_data;
  cudaStream_t stream = nullptr;

  Device(const ConstTensorView& q_host, const ConstTensorView& k_host,
         const ConstTensorView& v_host, const AttentionOptions& attention)
      : options(attention),
        q(q_host),
        k(k_host),
        v(v_host),
        q_data(bytes_of(q_host)),
        k_data(bytes_of(k_host)),
        v_data(bytes_of(v_host)),
        out_data(bytes_of(q_host)),
        lse_data(static_cast<std::size_t>(q_host.shape[0] * q_host.shape[1] * q_host.shape[2]) *
                 sizeof(float)) {
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
    for (auto [view, tensor] : {std::pair{&q, &q_data}, {&k, &k_data}, {&v, &v_data}}) {
      check(cudaMemcpy(tensor->data, view->data, tensor->bytes, cudaMemcpyHostToDevice),
            "cudaMemcpy");
      view->data = tensor->data;
    }
    out = {out_data.data, q.dtype, q.shape, q.strides};
  }
  ~Device() { cudaStreamDestroy(stream); }
};

CudaForwardRun::CudaForwardRun(const ConstTensorView& q, const ConstTensorView& k,
                               const ConstTensorView& v, const AttentionOptions& options) {
  if (!cuda::device_available()) {
    throw Error("--device cuda: expected a CUDA device of compute capability 8.0 or later, got " +
                cuda::device_description());
  }
  device_ = std::make_unique<Device>(q, k, v, options);
}

CudaForwardRun::~CudaForwardRun() = default;

void CudaForwardRun::operator()() {
  cuda::flash_attention_forward(device_->q, device_->k, device_->v, device_->out,
                                static_cast<float*>(device_->lse_data.data), device_->options,
                                device_->stream);
  check(cudaStreamSynchronize(device_->stream), "the forward");
}

void CudaForwardRun::copy_out(const TensorView& out, float* lse) const {
  check(
      cudaMemcpy(out.data, device_->out_data.data, device_->out_data.bytes, cudaMemcpyDeviceToHost),
      "cudaMemcpy");
  check(cudaMemcpy(lse, device_->lse_data.data, device_->lse_data.bytes, cudaMemcpyDeviceToHost),
        "cudaMemcpy");
}

}  // namespace flashattn::cli
