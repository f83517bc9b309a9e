// flashattn::cuda entry points: the CPU API's validation (api/params.cpp, which reads no tensor
// data), then what the GPU path adds: dtypes, head dims, alignment, device pointers, grid limits;
// the split-KV choice and its workspace; the launch.

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "api/fail.hpp"
#include "api/params.hpp"
#include "cuda/kernel_params.hpp"
#include "cuda/launch.hpp"
#include "flashattn/cuda.hpp"

namespace flashattn::cuda {
namespace {

using flashattn::detail::fail;

constexpr const char* kForward = "cuda::flash_attention_forward";
constexpr const char* kBackward = "cuda::flash_attention_backward";
constexpr int kMinComputeCapability = 80;
constexpr std::int64_t kMaxGridYZ = 65535;  // CUDA's limit on grid.y and grid.z
constexpr float kLog2e = 1.44269504088896341f;

void check_cuda(const char* caller, cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    fail(caller, what, ": ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
  }
}

// The current device's compute capability and multiprocessor count, or an Error saying why
// there is no usable device.
struct Device {
  int id = 0, compute_capability = 0, multiprocessors = 0;
};

Device current_device(const char* caller) {
  int count = 0;
  const cudaError_t counted = cudaGetDeviceCount(&count);
  if (counted != cudaSuccess) {
    cudaGetLastError();  // the error is not sticky; leave the runtime clean for the caller
    fail(caller, "expected a CUDA device, got none: ", cudaGetErrorString(counted));
  }
  if (count == 0) fail(caller, "expected a CUDA device, got none");
  Device device;
  check_cuda(caller, cudaGetDevice(&device.id), "cudaGetDevice");
  int major = 0, minor = 0;
  check_cuda(caller, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.id),
             "cudaDeviceGetAttribute");
  check_cuda(caller, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device.id),
             "cudaDeviceGetAttribute");
  check_cuda(
      caller,
      cudaDeviceGetAttribute(&device.multiprocessors, cudaDevAttrMultiProcessorCount, device.id),
      "cudaDeviceGetAttribute");
  device.compute_capability = 10 * major + minor;
  if (device.compute_capability < kMinComputeCapability) {
    fail(caller, "expected a device of compute capability 8.0 or later, got ", major, ".", minor);
  }
  return device;
}

// `name`'s memory must be reachable from the device: device or managed memory (host memory,
// registered or not, is refused: the kernels would read it over the bus, or not at all).
void check_device_pointer(const char* caller, const char* name, const void* data) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, data);
  if (status != cudaSuccess) {
    cudaGetLastError();
    fail(caller, name, ": expected device memory, got a pointer CUDA does not know (",
         cudaGetErrorString(status), ")");
  }
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    fail(caller, name, ": expected device or managed memory, got ",
         attributes.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory");
  }
}

// What the tensor-core kernels need of the views beyond the CPU contract: 16-byte rows.
void check_rows_copyable(const char* caller, const char* name, const ConstTensorView& view) {
  constexpr std::int64_t kElementsPer16Bytes = 8;
  for (int d = 0; d < 3; ++d) {
    if (view.shape[d] > 1 && view.strides[d] % kElementsPer16Bytes != 0) {
      fail(caller, name, ": expected strides that are multiples of 8 elements (16-byte rows), ",
           "got stride ", view.strides[d], " in dim ", d);
    }
  }
  if (reinterpret_cast<std::uintptr_t>(view.data) % 16 != 0) {
    fail(caller, name, ": expected data aligned to 16 bytes, got address ", view.data);
  }
}

void refuse_modifiers(const char* caller, const AttentionOptions& options) {
  const char* given = options.softcap != 0.0f         ? "softcap"
                      : !options.alibi_slopes.empty() ? "alibi_slopes"
                      : !options.sinks.empty()        ? "sinks"
                      : options.bias.data != nullptr  ? "bias"
                      : options.mask.data != nullptr  ? "mask"
                                                      : nullptr;
  if (given != nullptr) {
    fail(caller, given, ": expected none (the CUDA path has no score modifiers yet; the CPU ",
         "paths do), got one");
  }
  if (options.dropout_p != 0.0f) {
    fail(caller, "dropout_p: expected 0 (the CUDA path has no dropout yet; the CPU paths do), got ",
         options.dropout_p);
  }
}

detail::ForwardParams kernel_params(const flashattn::detail::AttentionParams& checked) {
  detail::ForwardParams p;
  p.q = checked.q;
  p.k = checked.k;
  p.v = checked.v;
  p.out = checked.out;
  p.lse = checked.lse;
  p.element = checked.dtype == DType::bf16 ? detail::Element::bf16 : detail::Element::f16;
  p.batch = static_cast<int>(checked.batch);
  p.heads_q = static_cast<int>(checked.heads_q);
  p.heads_kv = static_cast<int>(checked.heads_kv);
  p.head_dim = static_cast<int>(checked.head_dim);
  p.seqlen_q = checked.seqlen_q;
  p.seqlen_kv = checked.seqlen_kv;
  p.q_batch = checked.q_strides.batch;
  p.q_seq = checked.q_strides.seq;
  p.q_head = checked.q_strides.head;
  p.k_batch = checked.k_strides.batch;
  p.k_seq = checked.k_strides.seq;
  p.k_head = checked.k_strides.head;
  p.v_batch = checked.v_strides.batch;
  p.v_seq = checked.v_strides.seq;
  p.v_head = checked.v_strides.head;
  p.out_batch = checked.out_strides.batch;
  p.out_seq = checked.out_strides.seq;
  p.out_head = checked.out_strides.head;
  p.scale_log2 = checked.scale * kLog2e;
  p.causal = checked.causal;
  p.window_left = checked.window_left;
  p.window_right = checked.window_right;
  return p;
}

// What both passes ask beyond the CPU contract: a 16-bit dtype, a head_dim the tiles cover,
// 16-byte rows, grid dims within CUDA's limits.
void check_kernel_limits(const char* caller, const flashattn::detail::AttentionParams& checked,
                         std::int64_t max_head_dim,
                         std::initializer_list<std::pair<const char*, ConstTensorView>> views) {
  if (checked.dtype == DType::f32) {
    fail(caller, "q: expected dtype f16 or bf16 (the tensor cores' inputs; f32 runs on the CPU ",
         "paths), got f32");
  }
  if (checked.head_dim % 8 != 0 || checked.head_dim > max_head_dim) {
    fail(caller, "q: expected head_dim a multiple of 8 up to ", max_head_dim, ", got ",
         checked.head_dim);
  }
  if (checked.head_dim_v != checked.head_dim) {
    fail(caller, "v: expected head_dim_v = head_dim = ", checked.head_dim,
         " (the CUDA kernels take one head dim), got ", checked.head_dim_v);
  }
  for (const auto& [name, view] : views) check_rows_copyable(caller, name, view);
  for (const auto& [name, dim] : {std::pair{"heads_q", checked.heads_q},
                                  {"heads_kv", checked.heads_kv},
                                  {"batch", checked.batch}}) {
    if (dim > kMaxGridYZ) {
      fail(caller, "q: expected ", name, " <= ", kMaxGridYZ, " (a CUDA grid dim), got ", dim);
    }
  }
}

// A call's fp32 scratch from the stream-ordered allocator, freed on the same stream when the
// call leaves (the kernels queued before it are done with it by then, in stream order).
class Workspace {
 public:
  Workspace(const char* caller, const char* what, std::int64_t floats, cudaStream_t stream)
      : stream_(stream) {
    const cudaError_t allocated =
        cudaMallocAsync(&data_, static_cast<std::size_t>(floats) * sizeof(float), stream);
    if (allocated == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      fail(caller, "out of memory: could not allocate ", what, " (",
           floats * static_cast<std::int64_t>(sizeof(float)), " bytes of device memory)");
    }
    check_cuda(caller, allocated, "cudaMallocAsync");
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() { cudaFreeAsync(data_, stream_); }
  float* floats() const { return static_cast<float*>(data_); }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  for (int id = 0; id < count; ++id) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, id) == cudaSuccess &&
        10 * major >= kMinComputeCapability) {
      return true;
    }
  }
  return false;
}

std::string device_description() {
  int count = 0;
  const cudaError_t counted = cudaGetDeviceCount(&count);
  if (counted != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(counted);
  }
  if (count == 0) return "no CUDA device";
  int id = 0;
  cudaDeviceProp properties{};
  if (cudaGetDevice(&id) != cudaSuccess ||
      cudaGetDeviceProperties(&properties, id) != cudaSuccess) {
    cudaGetLastError();
    return "a CUDA device whose properties could not be read";
  }
  return std::string(properties.name) + ", compute capability " + std::to_string(properties.major) +
         "." + std::to_string(properties.minor) + ", " +
         std::to_string(properties.multiProcessorCount) + " multiprocessors, " +
         std::to_string(properties.totalGlobalMem >> 20) + " MiB";
}

void flash_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                             const ConstTensorView& v, const TensorView& out, float* lse,
                             const AttentionOptions& options, Stream stream) {
  flashattn::detail::out_of_memory_as_error(kForward, [&] {
    refuse_modifiers(kForward, options);
    const flashattn::detail::AttentionParams checked =
        flashattn::detail::make_params(kForward, q, k, v, out, lse, options);
    check_kernel_limits(kForward, checked, 256,
                        {{"q", q}, {"k", k}, {"v", v}, {"out", ConstTensorView(out)}});
    if (checked.batch == 0 || checked.seqlen_q == 0) return;

    const Device device = current_device(kForward);
    check_device_pointer(kForward, "q", q.data);
    check_device_pointer(kForward, "k", k.data);
    check_device_pointer(kForward, "v", v.data);
    check_device_pointer(kForward, "out", out.data);
    if (lse != nullptr) check_device_pointer(kForward, "lse", lse);

    detail::ForwardParams p = kernel_params(checked);
    const std::int64_t block_m = detail::forward_block_m();
    const int block_n = detail::forward_block_n(p.head_dim);
    const std::int64_t query_blocks = (p.seqlen_q + block_m - 1) / block_m;
    const std::int64_t key_blocks = (p.seqlen_kv + block_n - 1) / block_n;
    p.num_splits = detail::choose_splits(query_blocks * p.batch * p.heads_q, key_blocks,
                                         device.multiprocessors);
    while (p.num_splits > 1 && p.batch * static_cast<std::int64_t>(p.num_splits) > kMaxGridYZ) {
      --p.num_splits;
    }

    std::optional<Workspace> workspace;
    if (p.num_splits > 1) {
      p.blocks_per_split = static_cast<int>((key_blocks + p.num_splits - 1) / p.num_splits);
      const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.heads_q * p.seqlen_q;
      workspace.emplace(kForward, "the split-KV workspace", p.num_splits * rows * (p.head_dim + 1),
                        stream);
      p.split_out = workspace->floats();
      p.split_lse = p.split_out + p.num_splits * rows * p.head_dim;
    }
    check_cuda(kForward, detail::launch_flash_forward(p, stream), "kernel launch");
  });
}

void flash_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v,
                              const ConstTensorView& out, const float* lse, const TensorView& dq,
                              const TensorView& dk, const TensorView& dv,
                              const AttentionOptions& options, Stream stream) {
  flashattn::detail::out_of_memory_as_error(kBackward, [&] {
    refuse_modifiers(kBackward, options);
    const flashattn::detail::BackwardParams checked = flashattn::detail::make_backward_params(
        kBackward, dout, q, k, v, out, lse, dq, dk, dv, options);
    const flashattn::detail::AttentionParams& f = checked.forward;
    check_kernel_limits(kBackward, f, 128,
                        {{"q", q},
                         {"k", k},
                         {"v", v},
                         {"out", out},
                         {"dout", dout},
                         {"dq", ConstTensorView(dq)},
                         {"dk", ConstTensorView(dk)},
                         {"dv", ConstTensorView(dv)}});
    if (f.batch == 0 || (f.seqlen_q == 0 && f.seqlen_kv == 0)) return;

    current_device(kBackward);
    for (const auto& [name, data] : {std::pair<const char*, const void*>{"dout", dout.data},
                                     {"q", q.data},
                                     {"k", k.data},
                                     {"v", v.data},
                                     {"out", out.data},
                                     {"lse", lse},
                                     {"dq", dq.data},
                                     {"dk", dk.data},
                                     {"dv", dv.data}}) {
      if (data != nullptr) check_device_pointer(kBackward, name, data);
    }

    detail::BackwardParams b;
    b.forward = kernel_params(f);
    b.forward.lse = const_cast<float*>(lse);
    b.dout = dout.data;
    b.dq = dq.data;
    b.dk = dk.data;
    b.dv = dv.data;
    b.dout_batch = checked.dout_strides.batch;
    b.dout_seq = checked.dout_strides.seq;
    b.dout_head = checked.dout_strides.head;
    b.dq_batch = checked.dq_strides.batch;
    b.dq_seq = checked.dq_strides.seq;
    b.dq_head = checked.dq_strides.head;
    b.dk_batch = checked.dk_strides.batch;
    b.dk_seq = checked.dk_strides.seq;
    b.dk_head = checked.dk_strides.head;
    b.dv_batch = checked.dv_strides.batch;
    b.dv_seq = checked.dv_strides.seq;
    b.dv_head = checked.dv_strides.head;
    b.scale = f.scale;

    // dq's fp32 sums [batch, seqlen_q, heads_q, head_dim] and D [batch, heads_q, seqlen_q].
    const std::int64_t rows = f.batch * f.heads_q * f.seqlen_q;
    std::optional<Workspace> workspace;
    if (rows > 0) {
      workspace.emplace(kBackward, "the backward's workspace", rows * (f.head_dim + 1), stream);
      b.dq_sum = workspace->floats();
      b.row_dot = b.dq_sum + rows * f.head_dim;
      check_cuda(
          kBackward,
          cudaMemsetAsync(b.dq_sum, 0, static_cast<std::size_t>(rows * f.head_dim) * sizeof(float),
                          stream),
          "cudaMemsetAsync");
    }
    check_cuda(kBackward, detail::launch_flash_backward(b, stream), "kernel launch");
  });
}

}  // namespace flashattn::cuda
