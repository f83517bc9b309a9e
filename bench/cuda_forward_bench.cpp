// flashattn_cuda_bench: the CUDA forward and backward timed against the GPU's own ceilings,
// measured in the same run (a cuBLAS bf16 matrix product for arithmetic, a device-to-device copy
// for memory). Every forward case is verified on sampled rows against the fp64 reference before
// it is timed; the backward once, on a smaller problem, against the fp64 reference backward.
// scripts/gpu-check runs it; bench/README.md describes the columns.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashattn/cuda.hpp"
#include "flashattn/flashattn.hpp"

namespace {

using namespace flashattn;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}
void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(status));
  }
}

struct DeviceBuffer {
  void* data = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { check(cudaMalloc(&data, bytes), "cudaMalloc"); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(data); }
};

// 16-bit random normal values, as raw bits of `dtype`.
std::vector<std::uint16_t> random_values(std::size_t count, DType dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> bits(count);
  for (auto& b : bits)
    b = dtype == DType::bf16 ? bf16_from_f32(normal(rng)) : f16_from_f32(normal(rng));
  return bits;
}

// Median seconds of one call of `body` on `stream`: calls in rounds of at least ~20 ms each,
// timed by CUDA events, after a warm-up round.
template <class Body>
double median_seconds(cudaStream_t stream, int rounds, Body&& body) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  auto time_calls = [&](int calls) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < calls; ++i) body();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return ms * 1e-3 / calls;
  };
  const double first = time_calls(1);
  const int calls = std::clamp(static_cast<int>(0.02 / std::max(first, 1e-7)), 1, 1000);
  std::vector<double> times;
  for (int r = 0; r < rounds; ++r) times.push_back(time_calls(calls));
  std::sort(times.begin(), times.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return times[times.size() / 2];
}

struct Ceilings {
  double gemm_tflops = 0;  // cuBLAS bf16 8192^3, fp32 accumulation, random data
  double copy_gbps = 0;    // device-to-device copy, bytes read + written
};

Ceilings measure_ceilings(cudaStream_t stream, std::mt19937_64& rng) {
  Ceilings ceilings;
  constexpr int n = 8192;
  const std::size_t elements = static_cast<std::size_t>(n) * n;
  DeviceBuffer a(elements * 2), b(elements * 2), c(elements * 2);
  const auto values = random_values(elements, DType::bf16, rng);
  check(cudaMemcpy(a.data, values.data(), elements * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(b.data, values.data(), elements * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  cublasHandle_t handle;
  check(cublasCreate(&handle), "cublasCreate");
  check(cublasSetStream(handle, stream), "cublasSetStream");
  const float one = 1.0f, zero = 0.0f;
  const double gemm = median_seconds(stream, 5, [&] {
    check(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.data, CUDA_R_16BF, n,
                       b.data, CUDA_R_16BF, n, &zero, c.data, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
  });
  ceilings.gemm_tflops = 2.0 * n * n * static_cast<double>(n) / gemm * 1e-12;
  cublasDestroy(handle);

  const std::size_t copy_bytes = std::size_t{2} << 30;
  DeviceBuffer from(copy_bytes), to(copy_bytes);
  check(cudaMemset(from.data, 1, copy_bytes), "cudaMemset");
  const double copy = median_seconds(stream, 5, [&] {
    check(cudaMemcpyAsync(to.data, from.data, copy_bytes, cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync");
  });
  ceilings.copy_gbps = 2.0 * static_cast<double>(copy_bytes) / copy * 1e-9;
  return ceilings;
}

struct Case {
  std::int64_t batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim;
  bool causal;
  DType dtype;
};

struct Result {
  double seconds = 0, tflops = 0, kv_gbps = 0, worst_error_over_bound = 0;
  double backward_seconds = 0, backward_tflops = 0;  // prefill cases, when asked for
};

// The largest |error| / bound over `samples` rows of batch entry 0, query head 0, against the
// fp64 reference on that row alone (a one-row query slice and the keys it sees, non-causal).
double verify(const Case& c, const std::vector<std::uint16_t>& q,
              const std::vector<std::uint16_t>& k, const std::vector<std::uint16_t>& v,
              const std::vector<std::uint16_t>& out, int samples, std::mt19937_64& rng) {
  const double u = c.dtype == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  auto as_float = [&](std::uint16_t bits) {
    return c.dtype == DType::bf16 ? f32_from_bf16(bits) : f32_from_f16(bits);
  };
  std::vector<float> k32(static_cast<std::size_t>(c.seqlen_kv * c.heads_kv * c.head_dim));
  std::vector<float> v32(k32.size());
  double max_q = 0, max_k = 0, max_v = 0;
  for (std::size_t i = 0; i < k32.size(); ++i) {
    k32[i] = as_float(k[i]);
    v32[i] = as_float(v[i]);
    max_k = std::max(max_k, std::abs(double(k32[i])));
    max_v = std::max(max_v, std::abs(double(v32[i])));
  }
  const double dim = static_cast<double>(c.head_dim);
  std::uniform_int_distribution<std::int64_t> pick(0, c.seqlen_q - 1);
  double worst = 0;
  for (int sample = 0; sample < samples; ++sample) {
    const std::int64_t row = sample == 0 ? c.seqlen_q - 1 : pick(rng);
    std::vector<float> q_row(static_cast<std::size_t>(c.heads_q * c.head_dim));
    for (std::size_t i = 0; i < q_row.size(); ++i) {
      q_row[i] = as_float(q[static_cast<std::size_t>(row * c.heads_q * c.head_dim) + i]);
      max_q = std::max(max_q, std::abs(double(q_row[i])));
    }
    const std::int64_t keys = c.causal ? row + c.seqlen_kv - c.seqlen_q + 1 : c.seqlen_kv;
    std::vector<float> ref(q_row.size());
    reference_attention_forward(contiguous_view(q_row.data(), {1, 1, c.heads_q, c.head_dim}),
                                contiguous_view(k32.data(), {1, keys, c.heads_kv, c.head_dim}),
                                contiguous_view(v32.data(), {1, keys, c.heads_kv, c.head_dim}),
                                contiguous_view(ref.data(), {1, 1, c.heads_q, c.head_dim}),
                                nullptr);
    const double score_error = dim * std::ldexp(1.0, -24) * dim * max_q * max_k / std::sqrt(dim);
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double got = as_float(out[static_cast<std::size_t>(row * c.heads_q * c.head_dim) + i]);
      const double bound = u * max_v + u * std::abs(double(ref[i])) + 2 * score_error * max_v;
      const double ratio = std::isnan(got) ? INFINITY : std::abs(got - ref[i]) / bound;
      worst = std::max(worst, ratio);
    }
  }
  return worst;
}

ConstTensorView device_view(const DeviceBuffer& buffer, DType dtype, std::int64_t batch,
                            std::int64_t seqlen, std::int64_t heads, std::int64_t head_dim) {
  const std::array<std::int64_t, 4> shape{batch, seqlen, heads, head_dim};
  return {buffer.data, dtype, shape, contiguous_strides(shape)};
}

TensorView mutable_view(const ConstTensorView& view) {
  return {const_cast<void*>(view.data), view.dtype, view.shape, view.strides};
}

std::vector<std::uint16_t> upload(const DeviceBuffer& buffer, std::size_t count, DType dtype,
                                  std::mt19937_64& rng) {
  auto values = random_values(count, dtype, rng);
  check(cudaMemcpy(buffer.data, values.data(), count * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  return values;
}

Result run_case(const Case& c, bool time_backward, cudaStream_t stream, std::mt19937_64& rng) {
  const std::size_t q_count =
      static_cast<std::size_t>(c.batch * c.seqlen_q * c.heads_q * c.head_dim);
  const std::size_t kv_count =
      static_cast<std::size_t>(c.batch * c.seqlen_kv * c.heads_kv * c.head_dim);
  DeviceBuffer q_device(q_count * 2), k_device(kv_count * 2), v_device(kv_count * 2),
      out_device(q_count * 2);
  DeviceBuffer lse_device(static_cast<std::size_t>(c.batch * c.heads_q * c.seqlen_q) * 4);
  const auto q = upload(q_device, q_count, c.dtype, rng);
  const auto k = upload(k_device, kv_count, c.dtype, rng);
  const auto v = upload(v_device, kv_count, c.dtype, rng);
  check(cudaMemset(out_device.data, 0xff, q_count * 2), "cudaMemset");

  const ConstTensorView qv =
      device_view(q_device, c.dtype, c.batch, c.seqlen_q, c.heads_q, c.head_dim);
  const ConstTensorView kv =
      device_view(k_device, c.dtype, c.batch, c.seqlen_kv, c.heads_kv, c.head_dim);
  const ConstTensorView vv =
      device_view(v_device, c.dtype, c.batch, c.seqlen_kv, c.heads_kv, c.head_dim);
  const TensorView ov =
      mutable_view(device_view(out_device, c.dtype, c.batch, c.seqlen_q, c.heads_q, c.head_dim));
  float* lse = static_cast<float*>(lse_device.data);
  AttentionOptions options;
  options.causal = c.causal;
  auto forward = [&] { cuda::flash_attention_forward(qv, kv, vv, ov, lse, options, stream); };

  forward();
  check(cudaStreamSynchronize(stream), "the forward");
  std::vector<std::uint16_t> out(q_count);
  check(cudaMemcpy(out.data(), out_device.data, q_count * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
  Result result;
  result.worst_error_over_bound = verify(c, q, k, v, out, 8, rng);
  if (!(result.worst_error_over_bound <= 1.0)) return result;  // not timed: wrong

  result.seconds = median_seconds(stream, 7, forward);
  result.tflops =
      attention_flops(c.batch, c.heads_q, c.seqlen_q, c.seqlen_kv, c.head_dim, options) /
      result.seconds * 1e-12;
  result.kv_gbps = 2.0 * static_cast<double>(kv_count) * 2 / result.seconds * 1e-9;

  if (time_backward) {
    DeviceBuffer dout_device(q_count * 2), dq_device(q_count * 2), dk_device(kv_count * 2),
        dv_device(kv_count * 2);
    upload(dout_device, q_count, c.dtype, rng);
    const ConstTensorView dout =
        device_view(dout_device, c.dtype, c.batch, c.seqlen_q, c.heads_q, c.head_dim);
    const TensorView dq =
        mutable_view(device_view(dq_device, c.dtype, c.batch, c.seqlen_q, c.heads_q, c.head_dim));
    const TensorView dk =
        mutable_view(device_view(dk_device, c.dtype, c.batch, c.seqlen_kv, c.heads_kv, c.head_dim));
    const TensorView dv =
        mutable_view(device_view(dv_device, c.dtype, c.batch, c.seqlen_kv, c.heads_kv, c.head_dim));
    result.backward_seconds = median_seconds(stream, 5, [&] {
      cuda::flash_attention_backward(dout, qv, kv, vv, ov, lse, dq, dk, dv, options, stream);
    });
    result.backward_tflops =
        attention_backward_flops(c.batch, c.heads_q, c.seqlen_q, c.seqlen_kv, c.head_dim, options) /
        result.backward_seconds * 1e-12;
  }
  return result;
}

// The backward once on [1, 1024, 2, head_dim] causal against the fp64 reference backward:
// ‖g − ref‖ / ‖ref‖ for dq, dk and dv, over the dtype's unit roundoff u; the largest of the
// three. tests/cuda holds every element to a derived bound; this is the benchmark's check that
// the code it times is that code.
double check_backward(DType dtype, std::int64_t head_dim, cudaStream_t stream,
                      std::mt19937_64& rng) {
  constexpr std::int64_t kSeq = 1024, kHeads = 2;
  const std::size_t count = static_cast<std::size_t>(kSeq * kHeads * head_dim);
  DeviceBuffer q_device(count * 2), k_device(count * 2), v_device(count * 2),
      dout_device(count * 2), out_device(count * 2), lse_device(kSeq * kHeads * 4),
      dq_device(count * 2), dk_device(count * 2), dv_device(count * 2);
  const auto q = upload(q_device, count, dtype, rng), k = upload(k_device, count, dtype, rng),
             v = upload(v_device, count, dtype, rng), dout = upload(dout_device, count, dtype, rng);
  auto view = [&](const DeviceBuffer& b) {
    return device_view(b, dtype, 1, kSeq, kHeads, head_dim);
  };
  AttentionOptions options;
  options.causal = true;
  float* lse = static_cast<float*>(lse_device.data);
  cuda::flash_attention_forward(view(q_device), view(k_device), view(v_device),
                                mutable_view(view(out_device)), lse, options, stream);
  cuda::flash_attention_backward(view(dout_device), view(q_device), view(k_device), view(v_device),
                                 view(out_device), lse, mutable_view(view(dq_device)),
                                 mutable_view(view(dk_device)), mutable_view(view(dv_device)),
                                 options, stream);
  check(cudaStreamSynchronize(stream), "the backward");

  auto widen = [&](const std::vector<std::uint16_t>& bits) {
    std::vector<float> values(bits.size());
    for (std::size_t i = 0; i < bits.size(); ++i) {
      values[i] = dtype == DType::bf16 ? f32_from_bf16(bits[i]) : f32_from_f16(bits[i]);
    }
    return values;
  };
  auto download = [&](const DeviceBuffer& b) {
    std::vector<std::uint16_t> bits(count);
    check(cudaMemcpy(bits.data(), b.data, count * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return widen(bits);
  };
  std::vector<float> q32 = widen(q), k32 = widen(k), v32 = widen(v), dout32 = widen(dout);
  std::vector<float> out(count), ref_lse(kSeq * kHeads), dq(count), dk(count), dv(count);
  const std::array<std::int64_t, 4> shape{1, kSeq, kHeads, head_dim};
  reference_attention_forward(contiguous_view(q32.data(), shape),
                              contiguous_view(k32.data(), shape),
                              contiguous_view(v32.data(), shape),
                              contiguous_view(out.data(), shape), ref_lse.data(), options);
  reference_attention_backward(
      contiguous_view(dout32.data(), shape), contiguous_view(q32.data(), shape),
      contiguous_view(k32.data(), shape), contiguous_view(v32.data(), shape),
      contiguous_view(out.data(), shape), ref_lse.data(), contiguous_view(dq.data(), shape),
      contiguous_view(dk.data(), shape), contiguous_view(dv.data(), shape), options);
  const double u = dtype == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  double worst = 0;
  for (const auto& [device, reference] :
       {std::pair{&dq_device, &dq}, {&dk_device, &dk}, {&dv_device, &dv}}) {
    const std::vector<float> got = download(*device);
    double error = 0, norm = 0;
    for (std::size_t i = 0; i < count; ++i) {
      error += (double(got[i]) - (*reference)[i]) * (double(got[i]) - (*reference)[i]);
      norm += double((*reference)[i]) * (*reference)[i];
    }
    const double ratio = std::sqrt(error / norm) / u;
    worst = std::isnan(ratio) ? INFINITY : std::max(worst, ratio);
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Times flashattn's CUDA forward and backward against the GPU's cuBLAS bf16 matrix rate and "
      "its copy bandwidth, measured in the same run; every forward case is verified on sampled "
      "rows against the fp64 reference first, the backward once on a smaller problem, and what "
      "fails is reported and not timed (exit status 1)."};
  std::vector<std::int64_t> seqlens = {1024, 2048, 4096, 8192, 16384};
  std::int64_t tokens = 16384, heads = 16, head_dim = 128, decode_keys = 131072;
  std::string dtype_name_arg = "bf16", csv_path;
  app.add_option("--seqlens", seqlens, "prefill sequence lengths (Sq = Skv)")
      ->capture_default_str();
  app.add_option("--tokens", tokens, "batch = tokens / seqlen (at least 1)")->capture_default_str();
  app.add_option("--heads", heads, "query and KV heads of the prefill cases")
      ->capture_default_str();
  app.add_option("--head-dim", head_dim, "head dim")
      ->capture_default_str()
      ->check(CLI::Range(8, 256));
  app.add_option("--decode-keys", decode_keys,
                 "keys of the decode case (B = 1, Hq = 32, Hkv = 8, one query); 0: none")
      ->capture_default_str();
  app.add_option("--dtype", dtype_name_arg, "bf16 or f16")
      ->check(CLI::IsMember({"bf16", "f16"}))
      ->capture_default_str();
  app.add_option("--csv", csv_path, "also write the results as CSV to this file");
  CLI11_PARSE(app, argc, argv);
  const DType dtype = dtype_name_arg == "bf16" ? DType::bf16 : DType::f16;

  if (!cuda::device_available()) {
    std::fprintf(stderr, "flashattn_cuda_bench: %s\n", cuda::device_description().c_str());
    return 2;
  }
  try {
    std::mt19937_64 rng(std::random_device{}());
    cudaStream_t stream;
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
    std::printf("device: %s\n", cuda::device_description().c_str());
    const Ceilings ceilings = measure_ceilings(stream, rng);
    std::printf("ceilings: cuBLAS bf16 8192^3 %.1f TFLOP/s; device copy %.0f GB/s\n",
                ceilings.gemm_tflops, ceilings.copy_gbps);

    // Rounding gives a norm-wise error of about u on random inputs (the tests hold every element
    // to a derived bound); above 8 u the backward is taken for wrong and not timed.
    constexpr double kBackwardLimit = 8.0;
    const bool backward_ok =
        head_dim > 128 || check_backward(dtype, head_dim, stream, rng) < kBackwardLimit;
    if (head_dim <= 128) {
      std::printf("backward check ([1, 1024, 2, %lld] causal, against the fp64 reference): %s\n",
                  static_cast<long long>(head_dim),
                  backward_ok ? "within 8 u (norm-wise)" : "WRONG: the backward is not timed");
    }

    std::vector<Case> cases;
    for (const std::int64_t s : seqlens) {
      for (const bool causal : {false, true}) {
        cases.push_back(
            {std::max<std::int64_t>(tokens / s, 1), s, s, heads, heads, head_dim, causal, dtype});
      }
    }
    if (decode_keys > 0) cases.push_back({1, 1, decode_keys, 32, 8, head_dim, false, dtype});

    std::ofstream csv;
    if (!csv_path.empty()) {
      csv.open(csv_path);
      csv << "dtype,batch,seqlen_q,seqlen_kv,heads_q,heads_kv,head_dim,causal,seconds,tflops,"
             "tflops_over_gemm,kv_gbps,kv_over_copy,error_over_bound,backward_seconds,"
             "backward_tflops,backward_over_gemm,gemm_tflops,copy_gbps\n";
    }
    std::printf("%-5s %4s %7s %7s %3s %3s %4s %6s %10s %8s %6s %8s %6s %6s %10s %8s %6s\n", "dtype",
                "B", "Sq", "Skv", "Hq", "Hkv", "D", "causal", "ms", "TFLOP/s", "/gemm", "KV GB/s",
                "/copy", "err/bd", "bwd ms", "TFLOP/s", "/gemm");
    bool all_verified = true;
    for (const Case& c : cases) {
      const Result r = run_case(c, backward_ok && c.seqlen_q > 1 && head_dim <= 128, stream, rng);
      const bool verified = r.worst_error_over_bound <= 1.0;
      all_verified = all_verified && verified;
      std::printf(
          "%-5s %4lld %7lld %7lld %3lld %3lld %4lld %6s %10.4f %8.1f %6.3f %8.0f %6.3f %6.3f "
          "%10.4f %8.1f %6.3f%s\n",
          dtype_name(c.dtype), static_cast<long long>(c.batch), static_cast<long long>(c.seqlen_q),
          static_cast<long long>(c.seqlen_kv), static_cast<long long>(c.heads_q),
          static_cast<long long>(c.heads_kv), static_cast<long long>(c.head_dim),
          c.causal ? "yes" : "no", r.seconds * 1e3, r.tflops, r.tflops / ceilings.gemm_tflops,
          r.kv_gbps, r.kv_gbps / ceilings.copy_gbps, r.worst_error_over_bound,
          r.backward_seconds * 1e3, r.backward_tflops, r.backward_tflops / ceilings.gemm_tflops,
          verified ? "" : "  WRONG: not timed");
      if (csv.is_open()) {
        csv << dtype_name(c.dtype) << ',' << c.batch << ',' << c.seqlen_q << ',' << c.seqlen_kv
            << ',' << c.heads_q << ',' << c.heads_kv << ',' << c.head_dim << ','
            << (c.causal ? 1 : 0) << ',' << r.seconds << ',' << r.tflops << ','
            << r.tflops / ceilings.gemm_tflops << ',' << r.kv_gbps << ','
            << r.kv_gbps / ceilings.copy_gbps << ',' << r.worst_error_over_bound << ','
            << r.backward_seconds << ',' << r.backward_tflops << ','
            << r.backward_tflops / ceilings.gemm_tflops << ',' << ceilings.gemm_tflops << ','
            << ceilings.copy_gbps << '\n';
      }
    }
    cudaStreamDestroy(stream);
    return all_verified && backward_ok ? 0 : 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "flashattn_cuda_bench: %s\n", error.what());
    return 1;
  }
}
