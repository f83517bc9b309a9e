// The multi-head attention layer of seed 000, for fp32 activations [batch, seqlen, H].
//
// Data flow of one forward call (self-attention: context = x, seqlen_kv = seqlen_q):
//
//   x       [B·Sq,  H] --sgemm W_Q [H, H]   (+b_Q)--> q   [B·Sq,  H]    = [B, Sq,  Nh,  Dh]
//   context [B·Skv, H] --sgemm W_K [H, Hkv] (+b_K)--> k   [B·Skv, Hkv]  = [B, Skv, Nkv, Dh]
//   context [B·Skv, H] --sgemm W_V [H, Hkv] (+b_V)--> v   [B·Skv, Hkv]  = [B, Skv, Nkv, Dh]
//   attention_forward(impl, q, k, v)             --> att [B·Sq,  H]    = [B, Sq,  Nh,  Dh]
//   att     [B·Sq,  H] --sgemm W_O [H, H]   (+b_O)--> y   [B·Sq,  H]
//
// with Hkv = Nkv·Dh. Splitting heads costs nothing: a row-major [B·S, Nh·Dh] matrix is the
// [B, S, Nh, Dh] tensor with strides {S·H, H, Dh, 1}, which attention_forward reads directly (the
// seed's [B, Nh, S, Dh] is the same memory through strides {S·H, Dh, H, 1}). Likewise the
// attention output, written as [B, Sq, Nh, Dh], already is the merged [B·Sq, H] matrix that the
// output projection multiplies.
//
// Buffers allocated per call (fp32): q and att, B·Sq·H each; k and v, B·Skv·Hkv each. Attention
// itself allocates only what the chosen impl needs (score_buffer_bytes). The layer keeps no
// per-call state, so forward is const.

#include "flashattn/mha.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <sstream>

#include "flashattn/error.hpp"

namespace flashattn {
namespace {

template <class... Parts>
[[noreturn]] void fail(const char* caller, const Parts&... parts) {
  std::ostringstream message;
  message << caller << ": ";
  (message << ... << parts);
  throw Error(message.str());
}

// Rows of a [batch·seqlen, H] matrix, or an Error when they overflow the int that CBLAS takes.
std::int64_t matrix_rows(const char* caller, const char* name, std::int64_t batch,
                         std::int64_t seqlen) {
  std::int64_t rows = 0;
  if (__builtin_mul_overflow(batch, seqlen, &rows) || rows > INT32_MAX) {
    fail(caller, name, ": expected batch * seqlen <= ", INT32_MAX, " (a CBLAS int), got ", batch,
         " * ", seqlen);
  }
  return rows;
}

// Whether [a, a + a_count) and [b, b + b_count) share an element. Compared as integers: `<` on
// pointers into different arrays is unspecified.
bool overlaps(const float* a, std::int64_t a_count, const float* b, std::int64_t b_count) {
  const auto a_begin = reinterpret_cast<std::uintptr_t>(a);
  const auto b_begin = reinterpret_cast<std::uintptr_t>(b);
  const auto a_end = a_begin + static_cast<std::uintptr_t>(a_count) * sizeof(float);
  const auto b_end = b_begin + static_cast<std::uintptr_t>(b_count) * sizeof(float);
  return a_count > 0 && b_count > 0 && a_begin < b_end && b_begin < a_end;
}

// out[rows, n] = in[rows, k] · weight[k, n] + bias[n] (bias may be empty), all row-major.
// The bias is broadcast into `out` first so that one sgemm with beta = 1 adds the product.
void project(float* out, const float* in, std::int64_t rows, std::int64_t k,
             const std::vector<float>& weight, const std::vector<float>& bias, std::int64_t n) {
  if (rows == 0) return;
  float beta = 0.0f;
  if (!bias.empty()) {
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy(bias.begin(), bias.end(), out + r * n);
    }
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
              static_cast<int>(n), static_cast<int>(k), 1.0f, in, static_cast<int>(k),
              weight.data(), static_cast<int>(n), beta, out, static_cast<int>(n));
}

// A buffer the next step overwrites entirely, so it is left uninitialized.
std::unique_ptr<float[]> scratch(std::int64_t count) {
  return std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(count));
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionConfig& config) : config_(config) {
  constexpr const char* caller = "MultiHeadAttention";
  if (config.hidden <= 0) fail(caller, "hidden: expected > 0, got ", config.hidden);
  if (config.num_heads <= 0) fail(caller, "num_heads: expected > 0, got ", config.num_heads);
  if (config.hidden % config.num_heads != 0) {
    fail(caller, "num_heads: expected a divisor of hidden = ", config.hidden, ", got ",
         config.num_heads);
  }
  if (config.num_kv_heads < 0) {
    fail(caller, "num_kv_heads: expected >= 0 (0 = num_heads), got ", config.num_kv_heads);
  }
  if (config.num_kv_heads > 0 && config.num_heads % config.num_kv_heads != 0) {
    fail(caller, "num_kv_heads: expected a divisor of num_heads = ", config.num_heads, ", got ",
         config.num_kv_heads);
  }

  // Every dimension reaches CBLAS as an int.
  if (config.hidden > INT32_MAX) {
    fail(caller, "hidden: expected <= ", INT32_MAX, " (a CBLAS int), got ", config.hidden);
  }

  const std::int64_t hidden = config.hidden;
  const auto square = static_cast<std::size_t>(hidden * hidden);
  const auto kv = static_cast<std::size_t>(hidden * kv_width());
  w_q_.resize(square);
  w_k_.resize(kv);
  w_v_.resize(kv);
  w_o_.resize(square);
  if (config.bias) {
    b_q_.resize(static_cast<std::size_t>(hidden));
    b_k_.resize(static_cast<std::size_t>(kv_width()));
    b_v_.resize(static_cast<std::size_t>(kv_width()));
    b_o_.resize(static_cast<std::size_t>(hidden));
  }
}

void MultiHeadAttention::init_random(std::uint64_t seed) {
  // mt19937_64 is specified bit for bit by the standard, and the conversion to float below is
  // ours (std::uniform_real_distribution differs between standard libraries), so a seed gives
  // the same weights everywhere.
  std::mt19937_64 engine(seed);
  const float bound = 1.0f / std::sqrt(static_cast<float>(config_.hidden));
  const auto uniform = [&] {
    const float unit = static_cast<float>(engine() >> 40) * 0x1.0p-24f;  // [0, 1), 24 bits
    return bound * (2.0f * unit - 1.0f);
  };
  for (std::vector<float>* weight : {&w_q_, &w_k_, &w_v_, &w_o_}) {
    for (float& w : *weight) w = uniform();
  }
  for (std::vector<float>* bias : {&b_q_, &b_k_, &b_v_, &b_o_}) {
    std::fill(bias->begin(), bias->end(), 0.0f);
  }
}

void MultiHeadAttention::forward(const float* x, std::int64_t batch, std::int64_t seqlen, float* y,
                                 const AttentionOptions& options, AttentionImpl impl) const {
  if (seqlen < 0) fail("MultiHeadAttention::forward", "seqlen: expected >= 0, got ", seqlen);
  forward(x, batch, seqlen, x, seqlen, y, options, impl);
}

void MultiHeadAttention::forward(const float* x, std::int64_t batch, std::int64_t seqlen_q,
                                 const float* context, std::int64_t seqlen_kv, float* y,
                                 const AttentionOptions& options, AttentionImpl impl) const {
  constexpr const char* caller = "MultiHeadAttention::forward";
  if (batch < 0) fail(caller, "batch: expected >= 0, got ", batch);
  if (seqlen_q < 0) fail(caller, "seqlen_q: expected >= 0, got ", seqlen_q);
  if (seqlen_kv < 0) fail(caller, "seqlen_kv: expected >= 0, got ", seqlen_kv);

  const std::int64_t hidden = config_.hidden;
  const std::int64_t rows_q = matrix_rows(caller, "x", batch, seqlen_q);
  const std::int64_t rows_kv = matrix_rows(caller, "context", batch, seqlen_kv);
  const std::int64_t q_count = rows_q * hidden;  // < 2^62: both factors are CBLAS ints
  const std::int64_t context_count = rows_kv * hidden;
  const std::int64_t kv_count = rows_kv * kv_width();

  if (q_count > 0 && x == nullptr) fail(caller, "x: expected a data pointer, got null");
  if (q_count > 0 && y == nullptr) fail(caller, "y: expected a data pointer, got null");
  if (context_count > 0 && context == nullptr) {
    fail(caller, "context: expected a data pointer, got null");
  }
  if (overlaps(y, q_count, x, q_count)) {
    fail(caller, "y: expected memory disjoint from x, got overlapping buffers");
  }
  if (overlaps(y, q_count, context, context_count)) {
    fail(caller, "y: expected memory disjoint from context, got overlapping buffers");
  }
  if (q_count == 0) return;

  const std::int64_t heads = config_.num_heads, heads_kv = num_kv_heads(), dim = head_dim();
  auto q = scratch(q_count);
  auto k = scratch(kv_count);
  auto v = scratch(kv_count);
  auto att = scratch(q_count);
  project(q.get(), x, rows_q, hidden, w_q_, b_q_, hidden);
  project(k.get(), context, rows_kv, hidden, w_k_, b_k_, kv_width());
  project(v.get(), context, rows_kv, hidden, w_v_, b_v_, kv_width());

  // Split heads: the projections above, read as [B, S, heads, Dh] with strides {S·H, H, Dh, 1}.
  const ConstTensorView q_heads = contiguous_view(q.get(), {batch, seqlen_q, heads, dim});
  const ConstTensorView k_heads = contiguous_view(k.get(), {batch, seqlen_kv, heads_kv, dim});
  const ConstTensorView v_heads = contiguous_view(v.get(), {batch, seqlen_kv, heads_kv, dim});
  const TensorView att_heads = contiguous_view(att.get(), {batch, seqlen_q, heads, dim});
  attention_forward(impl, q_heads, k_heads, v_heads, att_heads, nullptr, options);

  // Merge heads: att [B, Sq, heads, Dh] is the row-major [B·Sq, H] matrix.
  project(y, att.get(), rows_q, hidden, w_o_, b_o_, hidden);
}

}  // namespace flashattn
