#pragma once

// The one plain struct the API layer hands to a backend (docs/design.md, "The contract").
// Validation happens once, in make_params; backends assume every field is valid.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/kvcache.hpp"
#include "flashattn/varlen.hpp"

namespace flashattn::detail {

// Element strides of one [batch, seq, head, dim] operand; dim is contiguous.
struct Strides {
  std::int64_t batch = 0, seq = 0, head = 0;

  std::int64_t offset(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return b * batch + s * seq + h * head;
  }
};

// Keys [begin, end) visible to one query row; empty when begin >= end.
struct KeyRange {
  std::int64_t begin = 0, end = 0;
  bool empty() const { return begin >= end; }
};

// One row of a score tile holding keys [key_begin, key_begin + width): -inf on every key the
// row does not see (those before and after its one visible interval).
inline void mask_invisible(float* scores, KeyRange row_keys, std::int64_t key_begin,
                           std::int64_t width) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  const std::int64_t visible_begin = std::clamp(row_keys.begin - key_begin, std::int64_t{0}, width);
  const std::int64_t visible_end = std::clamp(row_keys.end - key_begin, visible_begin, width);
  std::fill(scores, scores + visible_begin, kMasked);
  std::fill(scores + visible_end, scores + width, kMasked);
}

// A bias or mask (options.hpp) seen as [batch, heads_q, seqlen_q, seqlen_kv]: the element
// strides of the dims it broadcasts are 0. `dtype` is the bias's; a mask's elements are bytes.
struct LogitView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t batch = 0, head = 0, row = 0, key = 0;

  std::int64_t offset(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    return b * batch + h * head + i * row + j * key;
  }
  float bias(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    return load_f32(data, dtype, offset(b, h, i, j));
  }
  bool kept(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    return static_cast<const unsigned char*>(data)[offset(b, h, i, j)] != 0;
  }
};

// The score modifiers of AttentionOptions (options.hpp), checked: at their defaults when off.
struct ScoreModifiers {
  float softcap = 0.0f;                 // > 0 when on
  const float* alibi_slopes = nullptr;  // [batch | 1, heads_q]
  std::int64_t alibi_batch_stride = 0;  // heads_q for per-entry slopes, 0 for shared ones
  const float* sinks = nullptr;         // [heads_q]
  LogitView bias, mask;                 // data null when off

  // Whether a bias or mask is given: a −inf logit may then be a masked key, and a row whose
  // keys are all masked gets output 0 and lse −inf rather than 0/0 (keys_all_masked).
  bool masks_logits() const { return bias.data != nullptr || mask.data != nullptr; }
  // Whether the logits differ from scale·q·k: the fast paths then turn each score tile into
  // logits first (cpu::modify_scores) and run their softmax steps with scale 1.
  bool change_logits() const { return softcap > 0.0f || alibi_slopes != nullptr || masks_logits(); }
  float alibi_slope(std::int64_t b, std::int64_t h) const {
    return alibi_slopes == nullptr ? 0.0f : alibi_slopes[b * alibi_batch_stride + h];
  }
};

// Attention dropout (AttentionOptions::dropout_p), checked: P_ij is multiplied by `scale` where
// kept and by 0 where dropped, the mask being util/dropout.hpp's. Off when p == 0.
struct Dropout {
  float p = 0.0f;
  float scale = 1.0f;           // 1 / (1 − p)
  std::uint32_t threshold = 0;  // a key is dropped when its 16-bit draw is below this
  std::uint64_t seed = 0;
  std::uint32_t offset = 0;
  // The mask's batch coordinate of batch entry 0: a varlen batch's sequence index.
  std::int64_t first_batch = 0;

  bool on() const { return p > 0.0f; }
};

// The scales of a quantized cache's K or V (flashattn/kvcache.hpp): the scale of dims
// [g·group_dims, (g + 1)·group_dims) of the row at (i, j, h) of the cache is
// data[strides.offset(i, j, h) + g·group_stride]. Null data for f32, f16 and bf16 caches.
struct ScaleView {
  float* data = nullptr;
  Strides strides;
  std::int64_t group_stride = 0, groups = 1, group_dims = 0;
};

struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [batch, heads_q, seqlen_q] (see lse_head_stride), or null
  DType dtype = DType::f32;

  std::int64_t batch = 0, seqlen_q = 0, seqlen_kv = 0, heads_q = 0, heads_kv = 0;
  // The pair of head dims: q and k have head_dim, v and out (dout, dv) head_dim_v (DeepSeek's
  // MLA: 192 and 128 in prefill, 576 and 512 in decode).
  std::int64_t head_dim = 0, head_dim_v = 0;
  Strides q_strides, k_strides, v_strides, out_strides;

  float scale = 1.0f;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  // Added to every row's diagonal key (key_range_for_length): 0 everywhere but in a block of a
  // longer sequence whose mask and ALiBi distances are the whole sequence's (block_attention.hpp,
  // the ring of src/dist/).
  std::int64_t diagonal_shift = 0;
  int num_threads = 1;  // resolved: >= 1
  ScoreModifiers modifiers;
  Dropout dropout;

  // A serving batch's KV cache (flashattn/kvcache.hpp) or one sequence of a paged varlen batch
  // (flashattn/varlen.hpp, PagedKVView), which only the decode path (cpu/flash_decode.cpp) is
  // handed; every other backend sees these at their defaults (layers/kv_cache.cpp gathers).
  //   q_dtype       q and out; `dtype` is then that of k and v (f32 q with a 16-bit cache)
  //   kv_lengths    [batch]: batch entry b's keys are its first kv_lengths[b] (<= seqlen_kv)
  //   block_table   [batch, block_table_stride]: key j of entry b is row j % page_size of page
  //                 block_table[b, j / page_size], the page being k's (v's) batch index
  //   kv_batch_index, kv_first_row   [batch] each, or null, without a block table: key j of
  //                 entry b is row kv_first_row[b] + j of k's batch kv_batch_index[b]
  //                 (KVCacheOptions' cache_leftpad and cache_batch_idx)
  DType q_dtype = DType::f32;
  const std::int64_t* kv_lengths = nullptr;
  const std::int32_t* block_table = nullptr;
  std::int64_t block_table_stride = 0, page_size = 0;
  const std::int32_t* kv_batch_index = nullptr;
  const std::int32_t* kv_first_row = nullptr;
  // `dtype` quantized (int8, fp8): the scales of k and v, read at kv_offset(k_scale.strides, ...)
  ScaleView k_scale, v_scale;

  std::int64_t group_size() const { return heads_q / heads_kv; }
  // The scale the softmax steps apply to a score tile: 1 once modify_scores made it logits.
  float tile_scale() const { return modifiers.change_logits() ? 1.0f : scale; }
  std::int64_t kv_head(std::int64_t head_q) const { return head_q / group_size(); }
  // Floats from one query head's lse to the next: -1 for seqlen_q (contiguous), the packed
  // total for a sequence of a varlen batch (flashattn/varlen.hpp: lse [heads_q, total_q]).
  std::int64_t lse_head_stride = -1;

  std::int64_t lse_index(std::int64_t b, std::int64_t h, std::int64_t row) const {
    return (b * heads_q + h) * (lse_head_stride < 0 ? seqlen_q : lse_head_stride) + row;
  }

  std::int64_t kv_length(std::int64_t b) const { return kv_lengths ? kv_lengths[b] : seqlen_kv; }

  // Element offset of key j of batch entry b, KV head h, in k or v (strides s).
  std::int64_t kv_offset(const Strides& s, std::int64_t b, std::int64_t j, std::int64_t h) const {
    if (block_table == nullptr) {
      return s.offset(kv_batch_index ? kv_batch_index[b] : b,
                      kv_first_row ? kv_first_row[b] + j : j, h);
    }
    return s.offset(block_table[b * block_table_stride + j / page_size], j % page_size, h);
  }

  // Keys from key j on that lie s.seq apart in memory: up to the end of j's page.
  std::int64_t contiguous_keys(std::int64_t j) const {
    return block_table == nullptr ? std::numeric_limits<std::int64_t>::max()
                                  : page_size - j % page_size;
  }

  // The mask as an interval per row, aligned to the bottom-right corner: row i sits on the
  // diagonal key i + seqlen_kv - seqlen_q (+ diagonal_shift).
  KeyRange key_range(std::int64_t row) const { return key_range_for_length(row, seqlen_kv); }

  // The same for batch entry b of a serving batch, on its own diagonal.
  KeyRange entry_key_range(std::int64_t b, std::int64_t row) const {
    return key_range_for_length(row, kv_length(b));
  }

  KeyRange key_range_for_length(std::int64_t row, std::int64_t length) const {
    const std::int64_t diagonal = row + length - seqlen_q + diagonal_shift;
    std::int64_t end = length;
    if (causal) end = std::min(end, diagonal + 1);
    if (window_right >= 0) end = std::min(end, diagonal + window_right + 1);
    std::int64_t begin = 0;
    if (window_left >= 0) begin = std::max(begin, diagonal - window_left);
    // A shifted diagonal can lie past the last key: the range is then empty, at the end.
    begin = std::min(begin, length);
    return {begin, std::max(begin, end)};
  }

  // Whether a bias or mask masks key j for query row `row` of (batch b, query head h): the mask
  // drops it or the bias is −inf. Such a key is skipped like one outside the causal mask: it
  // takes no part in the softmax, and its value row is never multiplied (0·inf).
  bool key_masked(std::int64_t b, std::int64_t h, std::int64_t row, std::int64_t j) const {
    return (modifiers.mask.data != nullptr && !modifiers.mask.kept(b, h, row, j)) ||
           (modifiers.bias.data != nullptr &&
            modifiers.bias.bias(b, h, row, j) == -std::numeric_limits<float>::infinity());
  }

  // Whether a bias or mask masks every key that query row `row` of (batch b, query head h) sees:
  // the row then counts as fully masked (output 0, lse its sink, no gradient), whatever q and k
  // hold. False without a bias or mask. O(keys): asked only of rows whose logits all came out
  // −inf.
  bool keys_all_masked(std::int64_t b, std::int64_t h, std::int64_t row) const {
    if (!modifiers.masks_logits()) return false;
    const KeyRange keys = key_range(row);
    for (std::int64_t j = keys.begin; j < keys.end; ++j) {
      if (!key_masked(b, h, row, j)) return false;
    }
    return true;
  }

  // Union of the key ranges of rows [row_begin, row_end): the begin and end are monotone in the
  // row, so the first row gives the lowest begin and the last row the highest end.
  KeyRange key_range(std::int64_t row_begin, std::int64_t row_end) const {
    return {key_range(row_begin).begin, key_range(row_end - 1).end};
  }
};

// The backward's operands beside the forward's (whose `out` is read, not written, and whose
// `lse` is required).
struct BackwardParams {
  AttentionParams forward;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides dout_strides, dq_strides, dk_strides, dv_strides;
  float* dsinks = nullptr;  // [heads_q], when asked for (flashattn::ModifierGradients)
  // For dbias (flashattn::ModifierGradients) on the standard path: the logits' gradient of every
  // (batch, query head, row, key), fp32 contiguous [batch, heads_q, seqlen_q, seqlen_kv], which
  // it writes (0 where masked) and the API layer sums into dbias. Null: not asked for, or the
  // flash path, which sums into dbias itself.
  float* dlogits = nullptr;
  TensorView dbias;
};

// Two partial attention states and where their merge goes (flashattn/merge.hpp): fp32 outputs
// [batch, seqlen, heads, head_dim] with their lse [batch, heads, seqlen]; `out` in out_dtype.
struct MergeParams {
  const float* out_a = nullptr;
  const float* out_b = nullptr;
  const float* lse_a = nullptr;
  const float* lse_b = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // or null
  DType out_dtype = DType::f32;
  std::int64_t batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  Strides a_strides, b_strides, out_strides;
  int num_threads = 1;  // resolved: >= 1

  std::int64_t lse_index(std::int64_t b, std::int64_t h, std::int64_t row) const {
    return (b * heads + h) * seqlen + row;
  }
};

// A call of kvcache_attention_forward (flashattn/kvcache.hpp): the attention over the cache as
// the decode path takes it (seqlen_kv the capacity, per-entry lengths, a block table for a paged
// cache, q_dtype possibly f32 over a 16-bit or quantized cache), and the rows to append first.
// attention.kv_lengths points into kv_lengths, whose buffer a move hands over and a copy would
// not: move-only, the moves the defaults.
struct KVCacheParams {
  AttentionParams attention;
  std::vector<std::int64_t> kv_lengths;  // [batch] cache_seqlens + seqlen_new
  const std::int32_t* cache_seqlens = nullptr;
  // Appended rows [batch, seqlen_new, heads_kv, head_dim (head_dim_v for v)] of new_dtype,
  // written to the cache.
  const void* k_new = nullptr;
  const void* v_new = nullptr;  // null with values_in_keys
  // A shared cache (MLA's latent rows, flashattn/kvcache.hpp): v_cache is k_cache's first
  // head_dim_v dims, and appending writes the k_new rows only.
  bool values_in_keys = false;
  DType new_dtype = DType::f32;
  Strides k_new_strides, v_new_strides;
  std::int64_t seqlen_new = 0;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  // Rotary embedding (flashattn/kvcache.hpp, RotaryEmbedding): off when rotary.cos is null.
  // q_positions_advance: q row i sits at cache_seqlens[b] + i, else every row at cache_seqlens[b].
  RotaryEmbedding rotary;
  bool q_positions_advance = false;

  KVCacheParams() = default;
  KVCacheParams(const KVCacheParams&) = delete;
  KVCacheParams& operator=(const KVCacheParams&) = delete;
  KVCacheParams(KVCacheParams&&) noexcept = default;
  KVCacheParams& operator=(KVCacheParams&&) noexcept = default;
};

// A call of quantize_kv (flashattn/kvcache.hpp): rows [batch, seq, heads, head_dim] of values
// into the cache of `dtype`, with their scales.
struct QuantizeParams {
  const void* values = nullptr;
  DType values_dtype = DType::f32;
  Strides values_strides;
  void* cache = nullptr;
  DType dtype = DType::int8;
  Strides cache_strides;
  ScaleView scales;
  std::int64_t batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  int num_threads = 1;  // resolved: >= 1
};

// Validates the call and resolves defaults (scale, threads). `caller` prefixes every message.
// `modifier_batch`: the batch entries that per-entry ALiBi slopes cover, when not q's batch (a
// varlen batch's sequences).
AttentionParams make_params(const char* caller, const ConstTensorView& q, const ConstTensorView& k,
                            const ConstTensorView& v, const TensorView& out, float* lse,
                            const AttentionOptions& options, std::int64_t modifier_batch = -1);

// The dropout of options whose dropout_p is checked (in [0, 1)); off when it is 0.
Dropout make_dropout(const AttentionOptions& options);

// Makes checked params a block of a longer sequence whose row i sits on key
// i + query_minus_key_offset (api/block_attention.hpp): the diagonal shifted, the windows
// re-capped for it. Refuses a bias, a mask or sinks, and a shift of the diagonal beyond ±2^59.
void place_block(const char* caller, AttentionParams& params, const AttentionOptions& options,
                 std::int64_t query_minus_key_offset);

KVCacheParams make_kvcache_params(const char* caller, const ConstTensorView& q,
                                  const KVCacheView& cache, const std::int32_t* cache_seqlens,
                                  const NewKeysValues& new_kv, const KVCacheOptions& cache_options,
                                  const TensorView& out, float* lse,
                                  const AttentionOptions& options);

// A varlen batch over a paged cache (flashattn/varlen.hpp, PagedKVView): q, out and lse checked
// as the packed forward's, k and v as pages, each sequence's key count (cu_seqlens_k, whose
// batch + 1 offsets the caller has checked to start at 0 and never decrease) against the capacity
// and the block-table entries that cover it. The params of the whole packed call: batch 1,
// seqlen_kv the capacity, block_table, block_table_stride and page_size the cache's.
AttentionParams make_paged_varlen_params(const char* caller, const ConstTensorView& q,
                                         const PagedKVView& kv, const std::int32_t* cu_seqlens_k,
                                         std::int64_t batch, const TensorView& out, float* lse,
                                         const AttentionOptions& options);

QuantizeParams make_quantize_params(const char* caller, const ConstTensorView& values,
                                    const TensorView& cache, const TensorView& scales,
                                    int num_threads);

MergeParams make_merge_params(const char* caller, const ConstTensorView& out_a, const float* lse_a,
                              const ConstTensorView& out_b, const float* lse_b,
                              const TensorView& out, float* lse, int num_threads);

BackwardParams make_backward_params(const char* caller, const ConstTensorView& dout,
                                    const ConstTensorView& q, const ConstTensorView& k,
                                    const ConstTensorView& v, const ConstTensorView& out,
                                    const float* lse, const TensorView& dq, const TensorView& dk,
                                    const TensorView& dv, const AttentionOptions& options,
                                    const ModifierGradients& modifier_gradients = {},
                                    std::int64_t modifier_batch = -1);

}  // namespace flashattn::detail
