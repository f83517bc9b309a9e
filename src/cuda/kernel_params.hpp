#pragma once

// What the host side (cuda_api.cpp, compiled by the C++ compiler) hands the kernels
// (flash_forward_sm80.cu, flash_backward_sm80.cu, compiled by nvcc), and the small pieces of
// arithmetic both sides share: the mask as one key interval per row, the key blocks a query block
// must visit, the query rows a key block is seen by, and how many splits a call's keys get. Plain
// structs and functions, so that the tests check them on the CPU against the CPU paths' definitions
// (tests/cuda/test_cuda.cpp).

#include <cstdint>

#ifdef __CUDACC__
#define FLASHATTN_HOST_DEVICE __host__ __device__
#else
#define FLASHATTN_HOST_DEVICE
#endif

namespace flashattn::cuda::detail {

enum class Element { f16, bf16 };

struct ForwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [batch, heads_q, seqlen_q], or null
  Element element = Element::bf16;

  int batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  std::int64_t seqlen_q = 0, seqlen_kv = 0;
  // Element strides of (batch, seq, head); the last dim is contiguous.
  std::int64_t q_batch = 0, q_seq = 0, q_head = 0;
  std::int64_t k_batch = 0, k_seq = 0, k_head = 0;
  std::int64_t v_batch = 0, v_seq = 0, v_head = 0;
  std::int64_t out_batch = 0, out_seq = 0, out_head = 0;

  float scale_log2 = 0.0f;  // softmax scale · log2(e): the kernels exponentiate with exp2
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;  // -1: unbounded; capped at Sq + Skv

  // Split-KV: split s of num_splits attends key blocks [s·blocks_per_split, (s+1)·...) and, when
  // num_splits > 1, writes its normalized fp32 output and lse to the workspace
  // [num_splits, batch, heads_q, seqlen_q, head_dim] and [num_splits, batch, heads_q, seqlen_q],
  // which combine_splits merges into out and lse.
  int num_splits = 1;
  int blocks_per_split = 0;
  float* split_out = nullptr;
  float* split_lse = nullptr;
};

// The backward's operands beside the forward's (whose out and lse it reads). Gradients have q's
// dtype; dq is summed in fp32 by every key block that sees its row (atomically, so its bits may
// differ from run to run), then scaled and rounded once.
struct BackwardParams {
  ForwardParams forward;  // out and lse are read
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  std::int64_t dout_batch = 0, dout_seq = 0, dout_head = 0;
  std::int64_t dq_batch = 0, dq_seq = 0, dq_head = 0;
  std::int64_t dk_batch = 0, dk_seq = 0, dk_head = 0;
  std::int64_t dv_batch = 0, dv_seq = 0, dv_head = 0;
  float scale = 0.0f;        // the softmax scale (dS = P ∘ (dP − D) is scaled into dq, dk)
  float* dq_sum = nullptr;   // workspace: fp32 [batch, seqlen_q, heads_q, head_dim], zeroed
  float* row_dot = nullptr;  // workspace: D = rowsum(dO ∘ O), fp32 [batch, heads_q, seqlen_q]
};

// Keys [begin, end) that query row `row` sees, the interval of
// AttentionParams::key_range_for_length (api/params.hpp) for an unshifted diagonal: bottom-right
// causal, windows on the same diagonal.
struct KeyInterval {
  std::int64_t begin = 0, end = 0;
};

FLASHATTN_HOST_DEVICE inline KeyInterval row_keys(const ForwardParams& p, std::int64_t row) {
  const std::int64_t diagonal = row + p.seqlen_kv - p.seqlen_q;
  std::int64_t end = p.seqlen_kv;
  if (p.causal && diagonal + 1 < end) end = diagonal + 1;
  if (p.window_right >= 0 && diagonal + p.window_right + 1 < end) {
    end = diagonal + p.window_right + 1;
  }
  std::int64_t begin = 0;
  if (p.window_left >= 0 && diagonal - p.window_left > begin) begin = diagonal - p.window_left;
  if (begin > p.seqlen_kv) begin = p.seqlen_kv;
  if (end < begin) end = begin;
  return {begin, end};
}

// The key blocks of `block_n` keys that query rows [row_begin, row_end) (row_end > row_begin)
// must visit: [first, last), from the first row's begin to the last row's end (both are
// monotone in the row). Empty (first == last) when no row sees a key.
struct BlockInterval {
  std::int64_t first = 0, last = 0;
};

FLASHATTN_HOST_DEVICE inline BlockInterval key_blocks(const ForwardParams& p,
                                                      std::int64_t row_begin, std::int64_t row_end,
                                                      int block_n) {
  const std::int64_t begin = row_keys(p, row_begin).begin;
  const std::int64_t end = row_keys(p, row_end - 1).end;
  if (end <= begin) return {0, 0};
  return {begin / block_n, (end + block_n - 1) / block_n};
}

// Whether every row of [row_begin, row_end) sees every key of [key_begin, key_end): the block
// then needs no mask. Row r's interval grows with r at both ends, so the last row has the
// largest begin and the first row the smallest end.
FLASHATTN_HOST_DEVICE inline bool block_fully_visible(const ForwardParams& p,
                                                      std::int64_t row_begin, std::int64_t row_end,
                                                      std::int64_t key_begin,
                                                      std::int64_t key_end) {
  return row_keys(p, row_end - 1).begin <= key_begin && key_end <= row_keys(p, row_begin).end;
}

// The query rows [first, last) that see at least one key of [key_begin, key_end): a row's
// interval begins and ends no earlier than the row before's, so the rows whose interval ends after
// key_begin are a suffix and those whose interval begins before key_end a prefix; found by
// bisection. Rows inside may still see none of these keys (an empty interval), which the mask
// then drops.
struct RowInterval {
  std::int64_t first = 0, last = 0;
};

FLASHATTN_HOST_DEVICE inline RowInterval query_rows(const ForwardParams& p, std::int64_t key_begin,
                                                    std::int64_t key_end) {
  std::int64_t low = 0, high = p.seqlen_q;  // first row whose interval ends after key_begin
  while (low < high) {
    const std::int64_t mid = low + (high - low) / 2;
    if (row_keys(p, mid).end > key_begin) {
      high = mid;
    } else {
      low = mid + 1;
    }
  }
  const std::int64_t first = low;
  high = p.seqlen_q;  // first row (from `first` on) whose interval begins at or after key_end
  while (low < high) {
    const std::int64_t mid = low + (high - low) / 2;
    if (row_keys(p, mid).begin >= key_end) {
      high = mid;
    } else {
      low = mid + 1;
    }
  }
  return {first, low};
}

// Splits of the key blocks for a grid of `work_items` query blocks (over all batch entries and
// heads) on `multiprocessors`: enough that the grid covers the GPU about twice (every
// multiprocessor holds two blocks of these kernels), never more than one split per 4 key blocks
// (a split's fixed cost, its fp32 partial write and merge, must stay small beside its work), at
// most 64. 1 when the query blocks alone fill the GPU.
inline int choose_splits(std::int64_t work_items, std::int64_t key_blocks, int multiprocessors) {
  const std::int64_t wanted = 2 * static_cast<std::int64_t>(multiprocessors);
  if (work_items <= 0 || work_items >= wanted) return 1;
  std::int64_t splits = (wanted + work_items - 1) / work_items;
  if (splits > key_blocks / 4) splits = key_blocks / 4;
  if (splits > 64) splits = 64;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

}  // namespace flashattn::cuda::detail
