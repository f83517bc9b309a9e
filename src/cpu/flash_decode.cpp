// FlashAttention forward for decoding: a few query rows per KV head (the next token, or a few,
// against a KV cache), where the forward is bound by reading K and V more than by its products.
//
// The tiled forward (flash_forward.cpp) packs every K/V block, a transpose of K and a copy of V,
// and walks one head's rows, Hkv·D floats apart: a page each in [B, S, H, D]. For a handful of
// query rows the packing is most of the work and the strided walk starves the hardware
// prefetchers (docs/tuning.md). Here K and V are read once, in memory order: a group of keys at
// a time (key_group) and within them head by head, the rows straight from the input (bf16 and
// f16 widened in registers; bf16 in pairs, against query rows and accumulators in bf16 pair
// order, see DecodePlan) or, where head_dim is not a whole number of vectors, widened into
// padded rows, against all of their head's query rows; a quantized cache's codes likewise, each
// key's score and each value row's weight multiplied by the row's scale (or, with a scale per
// group of dims, the rows dequantized first: cpu/kernels/cache_rows.cpp); an int8 cache's keys
// against q's rows rounded to 16-bit codes, in integers, where the CPU has AVX512-VNNI
// (DecodePlan::int8_products). Per block of Bk
// keys and per KV head h, for the rows r of its query heads and positions:
//   s[h][r][j] = q[h][r] · k[j, h]                     dot_rows          [rows x Bk] per head
//   softcap, ALiBi of scale·s (when asked for)         modify_scores
//   online softmax                                     online_softmax_tile
//   acc[h][r] += p[h][r][j] · v[j, h]                  axpy_rows         [rows x Dv] per head
// Masked (row, key) pairs are never computed: -inf scores, and no product with the value row,
// so a non-finite value reaches only the rows that see it. (Read rates against the tiled
// forward: docs/tuning.md.)
//
// A serving batch (flashattn/kvcache.hpp) runs here too: each batch entry has its own key count
// and chunks, and its K/V rows may lie in pages (AttentionParams::kv_offset), which the products
// read where they lie, at an offset per row where a key group crosses a page; the key groups and
// chunks are those of a dense cache holding the same rows, so the results are the same bit for
// bit, for any page size.
//
// Threads take (batch, key chunk) tasks; each chunk keeps its own m, l and acc for every row of
// its batch entry, and a last pass merges each row's chunks in chunk order:
//   m = max_c m_c,  l = Σ_c l_c·w_c,  out = Σ_c acc_c·w_c / l,  w_c = exp(scale·(m_c - m)).
// The chunks follow from the shape alone, so the result is the same for any thread count.
//
// Memory: per thread the batch entry's query rows (Hkv·rows x Dp), the score tiles of every head
// (Hkv·rows x Bk, no larger than the tiled forward's Br x Bc tile) and a key group's padded
// K/V rows; shared, m, l and acc of every chunk of every row: at most kCallChunks chunks and one
// more per batch entry, (B + 16)·Hkv·rows·(Dp + 2) floats, whatever the sequence lengths.

#include "cpu/flash_decode.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/kernels/cache_rows.hpp"
#include "cpu/kernels/int8_products.hpp"
#include "cpu/kernels/score_modifiers.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/tile_sizes.hpp"
#include "util/aligned_vector.hpp"
#include "util/convert.hpp"
#include "util/parallel.hpp"

namespace flashattn::detail {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Query rows per KV head (group · seqlen_q) up to which decoding takes this path. Beyond a few
// rows the products dominate, but a chunked key walk still beats the tiled forward, whose tasks
// are one per (batch entry, KV head) here, up to 32 rows (docs/tuning.md).
constexpr std::int64_t kMaxDecodeRows = 32;
// A chunk holds at least this many keys, so that merging it costs a row 1/256 of the chunk's
// products or less, and at most 1/kCallChunks of the keys of the whole call: one sequence splits
// into up to 16 chunks, and in a serving batch of ragged lengths the long sequences split while
// the short ones stay whole (one chunk per entry left a 32-request batch's longest sequence on
// one thread at the end: docs/tuning.md). Short caches split too: 128 keys rather than 512 let a
// 256-key cache run on 2 threads.
constexpr std::int64_t kMinChunkKeys = 128;
constexpr std::int64_t kCallChunks = 16;
// Keys whose K (V) rows one dot_rows (axpy_rows) call takes: each query row's accumulator is
// loaded and stored once per group instead of once per key. 16 for 16-bit rows, 0.86-0.96 of the
// time of 8 with the spread prefetching on Ice Lake; f32 rows ran 4% slower with 16
// (docs/tuning.md). A function of the dtype only: a paged cache's keys are grouped as a dense
// one's, so that both give the same sums.
constexpr std::int64_t kMaxKeyGroup = 16;
std::int64_t key_group(DType dtype) { return dtype == DType::f32 ? 8 : kMaxKeyGroup; }
// Query rows per KV head up to which bf16 products take the rows in pairs (DecodePlan).
constexpr std::int64_t kMaxBf16PairRows = 8;
// How far ahead of the rows they read the products ask for rows (Prefetching::kSpread): 8 KiB,
// 4 calls of 16-bit rows of 128 dims (a KV head's rows of a key group each), 2 of f32 ones.
// On Ice Lake 0.87-0.93 of the time of asking for the next call's rows all at once; bf16 2 calls
// ahead 0.93-0.94, 6 1.02; f32 1 call 0.89-0.90, 3 0.90-0.98 (docs/tuning.md).
constexpr std::int64_t kBytesAhead = 8192;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The key chunks of one batch entry.
struct EntryChunks {
  KeyRange keys;                // the keys some row of the entry sees
  std::int64_t chunks = 1;      // key chunks
  std::int64_t chunk_keys = 0;  // keys per chunk, a multiple of kTileLanes
  std::int64_t first = 0;       // the entry's first chunk among all entries'

  KeyRange chunk(std::int64_t c) const {
    return {keys.begin + c * chunk_keys, std::min(keys.begin + (c + 1) * chunk_keys, keys.end)};
  }
};

// How one call is cut up: a function of the shape (and of a serving batch's lengths) only.
struct DecodePlan {
  std::int64_t rows = 0;        // query rows per KV head: row r = gi·seqlen_q + position
  std::int64_t block_keys = 0;  // Bk, keys per score tile
  std::int64_t key_group = 0;   // keys per product call (key_group)
  std::vector<EntryChunks> entries;
  std::int64_t total_chunks = 0;
  // The chunks, all entries' in a row, longest first: the order in which threads take them.
  std::vector<std::int64_t> order;
  // bf16 rows read as they are (both head dims whole numbers of vectors) whose products take them
  // in bf16 pairs (cpu::dot_rows_bf16_pairs): the query rows and accumulators are then kept in
  // bf16 pair order. Faster up to kMaxBf16PairRows rows per KV head, slower beyond them
  // (docs/tuning.md).
  bool bf16_pairs = false;
  // An int8 cache read in place whose scores come from integer products
  // (cpu::dot_rows_int8): the query rows are then also kept as 16-bit codes, Dq apart.
  bool int8_products = false;
};

// Whether the products read K and V rows where they lie: both head dims whole numbers of vectors,
// and a quantized cache with one scale per row (applied to the products' results); otherwise
// rows are widened, or dequantized group by group, into padded fp32 rows first.
bool rows_read_in_place(const AttentionParams& p) {
  return p.head_dim == cpu::pad_to_lanes(p.head_dim) &&
         p.head_dim_v == cpu::pad_to_lanes(p.head_dim_v) &&
         (!is_quantized(p.dtype) || (p.k_scale.groups == 1 && p.v_scale.groups == 1));
}

// Query codes per row for the integer products: head_dim padded to their steps of 32 dims.
std::int64_t query_code_stride(std::int64_t head_dim) { return (head_dim + 31) / 32 * 32; }

DecodePlan decode_plan(const AttentionParams& p) {
  DecodePlan plan;
  plan.rows = p.group_size() * p.seqlen_q;
  plan.key_group = key_group(p.dtype);
  auto pairs_fit = [](std::int64_t dims) {
    return dims == cpu::pad_to_lanes(dims) && dims % cpu::bf16_pair_chunk() == 0;
  };
  plan.bf16_pairs = p.dtype == DType::bf16 && pairs_fit(p.head_dim) && pairs_fit(p.head_dim_v) &&
                    plan.rows <= kMaxBf16PairRows;
  plan.int8_products = p.dtype == DType::int8 && rows_read_in_place(p) &&
                       p.head_dim <= cpu::kMaxInt8ProductDims &&
                       cpu::active_int8_products() == cpu::Int8Products::avx512_vnni;
  const cpu::TileSizes tiles = cpu::flash_tiles(p.head_dim, p.head_dim_v);
  const std::int64_t tile_floats = tiles.rows * tiles.keys;
  plan.block_keys = std::clamp(tile_floats / std::max<std::int64_t>(1, p.heads_kv * plan.rows) /
                                   cpu::kTileLanes * cpu::kTileLanes,
                               cpu::kTileLanes, std::int64_t{256});
  plan.entries.resize(static_cast<std::size_t>(p.batch));
  std::int64_t call_keys = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    EntryChunks& entry = plan.entries[b];
    if (p.seqlen_q > 0) {
      entry.keys = {p.entry_key_range(b, 0).begin, p.entry_key_range(b, p.seqlen_q - 1).end};
    }
    call_keys += entry.keys.empty() ? 0 : entry.keys.end - entry.keys.begin;
  }
  const std::int64_t max_chunk_keys = std::max(kMinChunkKeys, ceil_div(call_keys, kCallChunks));
  std::vector<std::int64_t> chunk_sizes;
  for (EntryChunks& entry : plan.entries) {
    entry.first = plan.total_chunks;
    const std::int64_t visible = entry.keys.empty() ? 0 : entry.keys.end - entry.keys.begin;
    if (visible > 0) {
      const std::int64_t chunks = ceil_div(visible, max_chunk_keys);
      entry.chunk_keys = ceil_div(ceil_div(visible, chunks), cpu::kTileLanes) * cpu::kTileLanes;
      entry.chunks = ceil_div(visible, entry.chunk_keys);
    }
    for (std::int64_t c = 0; c < entry.chunks; ++c) {
      const KeyRange keys = entry.chunk(c);
      chunk_sizes.push_back(keys.empty() ? 0 : keys.end - keys.begin);
    }
    plan.total_chunks += entry.chunks;
  }
  plan.order.resize(static_cast<std::size_t>(plan.total_chunks));
  std::iota(plan.order.begin(), plan.order.end(), std::int64_t{0});
  // std::sort rather than std::stable_sort, which falls back to another algorithm when its buffer
  // cannot be allocated (an allocation failure the fault-injection tests would see pass).
  std::sort(plan.order.begin(), plan.order.end(), [&](std::int64_t a, std::int64_t b) {
    return chunk_sizes[a] != chunk_sizes[b] ? chunk_sizes[a] > chunk_sizes[b] : a < b;
  });
  return plan;
}

// Each chunk's running statistics and accumulator for every row of its batch entry: row
// (h·rows + r) of chunk c of batch entry b is slot ((first_b + c)·Hkv + h)·rows + r.
// Dp is head_dim padded to whole vectors (q and K rows), Dvp head_dim_v (V rows, acc, out).
struct ChunkResults {
  UninitializedAlignedVector<float> max, sum, acc;  // acc: Dvp floats per slot
};

struct Scratch {
  AlignedVector<float> q;       // [Hkv·rows x Dp] the batch entry's query rows
  std::int64_t q_entry = -1;    // whose rows q holds: a thread's chunks are often one entry's
  AlignedVector<float> scores;  // [Hkv·rows x Bk]
  // [key group x max(Dp, Dvp)] K or V rows widened, zeros past their head dim (a head dim not a
  // whole number of vectors, or f16 without F16C)
  AlignedVector<float> inputs;
  // DecodePlan::int8_products: q's rows as 16-bit codes [Hkv·rows x Dq] and their scales.
  AlignedVector<std::int16_t> q_codes;
  AlignedVector<float> q_code_scales;
};

// The query positions that see key j: [first, last). Key ranges are monotone in the position
// (both ends), so those positions are one interval.
struct Positions {
  std::int64_t first, last;
};
Positions positions_seeing(const KeyRange* ranges, std::int64_t count, std::int64_t j) {
  std::int64_t first = 0, last = count;
  while (first < count && ranges[first].end <= j) ++first;
  while (last > first && ranges[last - 1].begin > j) --last;
  return {first, last};
}

// Rows (b, key .. key + count, h) of K or V, Dp (Dvp) elements of `dtype` each: the input itself
// where both head dims are whole numbers of vectors (the kernels widen bf16 and f16 in registers),
// otherwise rows widened to fp32 (floats past head_dim 0). A paged cache's rows are read in their
// pages, in the same groups of keys as a dense cache's, so that the products give the same sums.
struct InputRows {
  cpu::ScatteredRows rows;
  DType dtype;
  // A quantized cache's rows read where they lie (codes, unscaled): the scale of each row, by
  // which the products' results (K) or weights (V) are multiplied; null otherwise.
  const float* scales;
  // Rows like these that a later call takes, for the products to ask for as they read these
  // (cpu::dot_rows, cpu::axpy_rows and their bf16-pair forms); none when they were asked for
  // before the call.
  cpu::ScatteredRows ahead;
};

// How KeyWalk asks for the rows ahead of those a call reads, in pages the hardware prefetchers
// have not seen yet (docs/tuning.md has the variants and their rates):
enum class Prefetching {
  // The next call's rows (the next KV head's, or the next group's first), all at once before
  // the call: f32 on Zen 5, and every call whose rows are not read where they lie.
  kNextCall,
  // The whole rows (every KV head) of the next key group, a share of them per KV head,
  // in address order: 16-bit and 1-byte rows on Zen 5 (bf16 35-38 GB/s against 26-32 for
  // kNextCall); on Ice Lake 1.07-1.23x the time of kNextCall, on Zen 4 1.2-1.4x that of kSpread,
  // its prefetches waiting for fill buffers.
  kWholeRows,
  // Elsewhere: the rows kBytesAhead on, which the products ask for line by line as they read
  // their own (InputRows::ahead), so that no burst of prefetches waits for fill buffers while
  // the products wait behind it. Chosen on Ice Lake and on Zen 4; not measured on Zen 5.
  kSpread,
  // The same into L2 (ScatteredRows::into_l2): AMD's cores other than Zen 5, where on Zen 4 it
  // took 0.72-0.89 of kSpread's time from memory, up to 1.09 from L3 (docs/tuning.md).
  kSpreadIntoL2,
};

// Whether this is an AMD CPU; of family 26 (Zen 5), the one machine kind measured faster with
// the bursts of kNextCall and kWholeRows than without (docs/tuning.md).
bool amd() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool is_amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return is_amd;
#else
  return false;
#endif
}
bool amd_family_26() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool zen5 = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!amd() || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
    const unsigned base_family = (eax >> 8) & 0xfu, extended_family = (eax >> 20) & 0xffu;
    return base_family + (base_family == 0xfu ? extended_family : 0u) == 26u;
  }();
  return zen5;
#else
  return false;
#endif
}

Prefetching prefetching_for(DType dtype) {
  if (amd_family_26()) {
    return dtype == DType::f32 ? Prefetching::kNextCall : Prefetching::kWholeRows;
  }
  return amd() ? Prefetching::kSpreadIntoL2 : Prefetching::kSpread;
}

// The keys of one (batch entry, key chunk) task as memory lays them out, a key group at a time
// and within them KV head by KV head, handing each group of K or V rows to the rows that see it.
class KeyWalk {
 public:
  KeyWalk(const AttentionParams& p, const DecodePlan& plan, Scratch& t, std::int64_t b,
          KeyRange chunk)
      : p_(p),
        plan_(plan),
        t_(t),
        b_(b),
        chunk_begin_(chunk.begin),
        chunk_end_(chunk.end),
        prefetching_(prefetching_for(p.dtype)),
        element_bytes_(static_cast<std::int64_t>(dtype_size(p.dtype))),
        in_place_(rows_read_in_place(p)) {
    for (std::int64_t position = 0; position < p.seqlen_q; ++position) {
      ranges_[position] = p.entry_key_range(b, position);
    }
  }

  // The keys that query position `position` sees.
  KeyRange range(std::int64_t position) const { return ranges_[position]; }
  std::int64_t batch_entry() const { return b_; }

  // fn(first_row, row_count, key, key_count, rows) over the keys [block, block + keys) of K or V
  // (base, strides, rows of `dims` elements, and a quantized cache's scales), a key group at a
  // time, with their input rows.
  template <class Fn>
  void walk_inputs(const void* base, const Strides& strides, const ScaleView& scales,
                   std::int64_t dims, std::int64_t block, std::int64_t keys, Fn&& fn) {
    dims_ = dims;
    calls_ahead_ =
        std::max<std::int64_t>(1, kBytesAhead / (plan_.key_group * dims * element_bytes_));
    inputs_head_ = -1;
    inputs_key_ = -1;
    ahead_.key = -1;
    // The calls between the first and the one calls_ahead_ on are asked for on the chunk's first
    // block only: later walks of K (V) start on rows the previous one asked for as it ended.
    first_block_ = block == chunk_begin_;
    const std::int64_t group = plan_.key_group;
    for (std::int64_t j = block; j < block + keys; j += group) {
      visit(j, std::min(group, block + keys - j),
            [&](std::int64_t h, std::int64_t first, std::int64_t count, std::int64_t key,
                std::int64_t key_count) {
              fn(first, count, key, key_count, rows_of(base, strides, scales, h, key, key_count));
            });
    }
  }

 private:
  // Calls fn(h, first_row, row_count, key, key_count) so that each (row, key) pair of the keys
  // [j, j + n) that the mask shows comes once, and no other: all of them at once for all rows of
  // each KV head where every position sees the whole group, else key by key for the rows of the
  // positions that see the key, one query head of the group at a time.
  template <class Fn>
  void visit(std::int64_t j, std::int64_t n, Fn&& fn) const {
    const std::int64_t Sq = p_.seqlen_q, rows = plan_.rows;
    const Positions first = positions_seeing(ranges_, Sq, j);
    const Positions last = positions_seeing(ranges_, Sq, j + n - 1);
    if (first.first == 0 && first.last == Sq && last.first == 0 && last.last == Sq) {
      for (std::int64_t h = 0; h < p_.heads_kv; ++h) fn(h, h * rows, rows, j, n);
      return;
    }
    for (std::int64_t key = j; key < j + n; ++key) {
      const Positions seen = positions_seeing(ranges_, Sq, key);
      if (seen.first >= seen.last) continue;
      for (std::int64_t h = 0; h < p_.heads_kv; ++h) {
        for (std::int64_t gi = 0; gi < p_.group_size(); ++gi) {
          fn(h, h * rows + gi * Sq + seen.first, seen.last - seen.first, key, 1);
        }
      }
    }
  }

  // The call `calls` on from the one of KV head h and the group at `key` of `count` keys: the
  // next KV head's, after the last the next group's.
  struct Call {
    std::int64_t head, key;
  };
  Call call_ahead(std::int64_t h, std::int64_t key, std::int64_t count, std::int64_t calls) const {
    const std::int64_t head = h + calls;
    return {head % p_.heads_kv, key + head / p_.heads_kv * count};
  }

  // Asks for the rows of KV head h of the keys [key, key + count) within the chunk.
  void prefetch_call(const void* base, const Strides& strides, Call call,
                     std::int64_t count) const {
    for_each_key(strides, call.key, std::min(call.key + count, chunk_end_), [&](std::int64_t row) {
      prefetch_row(base, p_.dtype, row + call.head * strides.head, dims_);
    });
  }

  // Prefetching::kSpread, for rows read from the cache where they lie: the KV head of the call
  // calls_ahead_ calls on, whose rows (ahead_) the products are to ask for (InputRows::ahead), if
  // they are a whole key group within the chunk; the first call of a walk asks for the calls
  // between itself. Otherwise -1, having asked by prefetch_next. (f16 rows on targets without
  // F16C are widened before the products, which then ask for none: tile_kernels.cpp.)
  std::int64_t head_ahead(const void* base, const Strides& strides, std::int64_t h,
                          std::int64_t key, std::int64_t count, bool first_call) {
    if ((prefetching_ == Prefetching::kSpread || prefetching_ == Prefetching::kSpreadIntoL2) &&
        count == plan_.key_group && in_place_) {
      const Call target = call_ahead(h, key, count, calls_ahead_);
      if (target.key + count <= chunk_end_) {
        if (target.key != ahead_.key) locate(target.key, count, strides, ahead_);
        if (first_call) {
          for (std::int64_t calls = 1; calls < calls_ahead_; ++calls) {
            prefetch_call(base, strides, call_ahead(h, key, count, calls), count);
          }
        }
        return target.head;
      }
    }
    prefetch_next(base, strides, h, key, count);
    return -1;
  }

  // Asks for rows ahead of the ones this call reads before the call: the whole rows of the group
  // ahead (Prefetching::kWholeRows), else the next call's.
  void prefetch_next(const void* base, const Strides& strides, std::int64_t h, std::int64_t key,
                     std::int64_t count) const {
    if (prefetching_ == Prefetching::kWholeRows) {
      const std::int64_t group = plan_.key_group, ahead = key + group;
      const std::int64_t first = ahead + h * group / p_.heads_kv;
      const std::int64_t last = std::min(ahead + (h + 1) * group / p_.heads_kv, chunk_end_);
      for_each_key(strides, first, last, [&](std::int64_t row) {
        for (std::int64_t head = 0; head < p_.heads_kv; ++head) {
          prefetch_row(base, p_.dtype, row + head * strides.head, dims_);
        }
      });
      return;
    }
    prefetch_call(base, strides, call_ahead(h, key, count, 1), count);
  }

  // fn(offset) with the element offset of KV head 0's row of each key in [first, last): one
  // block-table lookup per page rather than per row and head, whose division by the page size
  // cost a paged 16-bit cache ~10% of its rate against a dense one (docs/tuning.md).
  template <class Fn>
  void for_each_key(const Strides& strides, std::int64_t first, std::int64_t last, Fn&& fn) const {
    for (std::int64_t j = first; j < last;) {
      const std::int64_t run = std::min(last - j, p_.contiguous_keys(j));
      std::int64_t row = p_.kv_offset(strides, b_, j, 0);
      for (std::int64_t i = 0; i < run; ++i, row += strides.seq) fn(row);
      j += run;
    }
  }

  // Where the K or V rows of a key group lie, for every KV head.
  struct GroupRows {
    std::int64_t key = -1, count = 0;  // the group's keys
    std::int64_t first = 0;            // the element offset of KV head 0's row of the first
    bool contiguous = false;           // whether the rows lie strides.seq apart (in one page)
    // The byte offsets of KV head 0's row of each key, once looked up (offsets_of).
    bool has_offsets = false;
    std::int64_t byte_offsets[kMaxKeyGroup];
  };
  void locate(std::int64_t key, std::int64_t count, const Strides& strides,
              GroupRows& group) const {
    group.key = key;
    group.count = count;
    group.first = p_.kv_offset(strides, b_, key, 0);
    group.contiguous = p_.contiguous_keys(key) >= count;
    group.has_offsets = false;
  }
  const std::int64_t* offsets_of(const Strides& strides, GroupRows& group) const {
    if (!group.has_offsets) {
      std::int64_t* offset = group.byte_offsets;
      for_each_key(strides, group.key, group.key + group.count,
                   [&](std::int64_t row) { *offset++ = row * element_bytes_; });
      group.has_offsets = true;
    }
    return group.byte_offsets;
  }
  // KV head h's rows of the group: strided, or at their offsets.
  cpu::ScatteredRows rows_in(const void* base, const Strides& strides, std::int64_t h,
                             GroupRows& group, bool strided) const {
    const auto* bytes = static_cast<const char*>(base);
    if (strided) return {bytes + (group.first + h * strides.head) * element_bytes_, strides.seq};
    return {bytes + h * strides.head * element_bytes_, 0, offsets_of(strides, group)};
  }

  // The input rows of the last call, kept while the query heads of a group take them in turn;
  // the rows ahead are asked for when these are first taken (head_ahead).
  const InputRows& rows_of(const void* base, const Strides& strides, const ScaleView& scales,
                           std::int64_t h, std::int64_t key, std::int64_t count) {
    if (h != inputs_head_ || key != inputs_key_ || count != inputs_count_) {
      const bool first_call = first_block_ && inputs_key_ < 0;
      if (key != inputs_key_ || count != inputs_count_) locate(key, count, strides, group_);
      const std::int64_t ahead = head_ahead(base, strides, h, key, count, first_call);
      const std::int64_t Dp = cpu::pad_to_lanes(dims_);
      if (in_place_) {
        // Strided where both groups lie in a page: the kernels take the rows ahead in the same
        // form as the rows.
        const bool strided = group_.contiguous && (ahead < 0 || ahead_.contiguous);
        const float* row_scales = nullptr;
        if (is_quantized(p_.dtype)) {
          // One block-table lookup per page, as for the rows.
          float* scale = row_scales_;
          for_each_key(scales.strides, key, key + count, [&](std::int64_t row) {
            *scale++ = scales.data[row + h * scales.strides.head];
          });
          row_scales = row_scales_;
        }
        inputs_ = {
            rows_in(base, strides, h, group_, strided), p_.dtype, row_scales,
            ahead < 0 ? cpu::ScatteredRows{} : rows_in(base, strides, ahead, ahead_, strided)};
        inputs_.ahead.into_l2 = prefetching_ == Prefetching::kSpreadIntoL2;
      } else if (is_quantized(p_.dtype)) {
        float* widened = t_.inputs.data();
        for (std::int64_t j = key; j < key + count; ++j, widened += Dp) {
          cpu::dequantize_row(
              widened, static_cast<const std::uint8_t*>(base) + p_.kv_offset(strides, b_, j, h),
              p_.dtype, scales.data + p_.kv_offset(scales.strides, b_, j, h), scales.group_stride,
              scales.group_dims, dims_);
          std::fill(widened + dims_, widened + Dp, 0.0f);
        }
        inputs_ = {{t_.inputs.data(), Dp}, DType::f32, nullptr, {}};
      } else {
        float* widened = t_.inputs.data();
        for_each_key(strides, key, key + count, [&](std::int64_t row) {
          load_row_f32(widened, base, p_.dtype, row + h * strides.head, dims_);
          // The padding is zeroed row by row: K and V rows of different widths share the buffer,
          // and a value left past one's dims would meet the zeros of the other's (0·inf = NaN).
          std::fill(widened + dims_, widened + Dp, 0.0f);
          widened += Dp;
        });
        inputs_ = {{t_.inputs.data(), Dp}, DType::f32, nullptr, {}};
      }
      inputs_head_ = h;
      inputs_key_ = key;
      inputs_count_ = count;
    }
    return inputs_;
  }

  const AttentionParams& p_;
  const DecodePlan& plan_;
  Scratch& t_;
  std::int64_t b_, chunk_begin_, chunk_end_;
  Prefetching prefetching_;
  std::int64_t element_bytes_;
  bool in_place_;                 // rows_read_in_place
  std::int64_t dims_ = 0;         // of the rows walked: head_dim for K, head_dim_v for V
  std::int64_t calls_ahead_ = 1;  // Prefetching::kSpread: kBytesAhead in calls
  KeyRange ranges_[kMaxDecodeRows];
  InputRows inputs_{{}, DType::f32, nullptr, {}};
  float row_scales_[kMaxKeyGroup];  // inputs_.scales of a quantized cache read in place
  std::int64_t inputs_head_ = -1, inputs_key_ = -1, inputs_count_ = 0;
  GroupRows group_;          // of inputs_key_
  bool first_block_ = true;  // whether the walk is over the chunk's first block
  GroupRows ahead_;  // of the rows ahead (head_ahead), looked up once for every KV head's call
};

// The running statistics and accumulator of one chunk, for every row of its batch entry.
struct ChunkState {
  float* row_max;  // [Hkv·rows]
  float* row_sum;  // [Hkv·rows]
  float* acc;      // [Hkv·rows x Dvp]
  KeyRange keys;   // the chunk's keys
};

// Prologue of a chunk: m = -inf, l = 0, acc = 0, and its keys.
ChunkState start_chunk(const AttentionParams& p, const DecodePlan& plan, ChunkResults& results,
                       std::int64_t b, std::int64_t chunk) {
  const std::int64_t slots = p.heads_kv * plan.rows, Dvp = cpu::pad_to_lanes(p.head_dim_v);
  const EntryChunks& entry = plan.entries[b];
  const std::int64_t slot = (entry.first + chunk) * slots;
  const ChunkState state{results.max.data() + slot, results.sum.data() + slot,
                         results.acc.data() + slot * Dvp, entry.chunk(chunk)};
  std::fill_n(state.row_max, slots, kNegativeInfinity);
  std::fill_n(state.row_sum, slots, 0.0f);
  std::fill_n(state.acc, slots * Dvp, 0.0f);
  return state;
}

// The batch entry's query rows into t.q, [Hkv·rows x Dp], in bf16 pair order for bf16 pairs.
void load_query_rows(const AttentionParams& p, const DecodePlan& plan, Scratch& t, std::int64_t b) {
  if (t.q_entry == b) return;
  t.q_entry = b;
  const std::int64_t rows = plan.rows, Sq = p.seqlen_q, Dp = cpu::pad_to_lanes(p.head_dim);
  for (std::int64_t h = 0; h < p.heads_kv; ++h) {
    for (std::int64_t r = 0; r < rows; ++r) {
      float* q_row = t.q.data() + (h * rows + r) * Dp;
      // In pair order by way of the input rows' buffer, which bf16 pairs leave unused.
      float* loaded = plan.bf16_pairs ? t.inputs.data() : q_row;
      load_row_f32(loaded, p.q, p.q_dtype,
                   p.q_strides.offset(b, r % Sq, h * p.group_size() + r / Sq), p.head_dim);
      if (plan.bf16_pairs) cpu::to_bf16_pair_order(q_row, loaded, Dp);
      if (plan.int8_products) {
        const std::int64_t Dq = query_code_stride(p.head_dim);
        const std::int64_t slot = h * rows + r;
        t.q_code_scales[slot] =
            cpu::quantize_query_row(t.q_codes.data() + slot * Dq, q_row, p.head_dim, Dq);
      }
    }
  }
}

// values[r·ld + j] ·= scales[j] for r < rows, j < n: a quantized cache's row scales on the scores
// of its codes, or on the probabilities that weight its value codes.
void scale_columns(float* values, std::int64_t ld, std::int64_t rows, const float* scales,
                   std::int64_t n) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < n; ++j) values[r * ld + j] *= scales[j];
  }
}

// s = q · k over the keys [block, block + keys), a key group at a time and head by head: the
// order of the rows in memory. Scores of masked pairs are -inf, set before.
void scores_step(const AttentionParams& p, const DecodePlan& plan, Scratch& t, KeyWalk& walk,
                 std::int64_t block, std::int64_t keys) {
  const std::int64_t Bk = plan.block_keys, Dp = cpu::pad_to_lanes(p.head_dim);
  float* scores = t.scores.data();
  for (std::int64_t slot_row = 0; slot_row < p.heads_kv * plan.rows; ++slot_row) {
    const KeyRange seen = walk.range(slot_row % plan.rows % p.seqlen_q);
    mask_invisible(scores + slot_row * Bk,
                   {std::max(seen.begin, block), std::min(seen.end, block + keys)}, block,
                   cpu::pad_to_lanes(keys));
  }
  walk.walk_inputs(
      p.k, p.k_strides, p.k_scale, p.head_dim, block, keys,
      [&](std::int64_t first, std::int64_t count, std::int64_t key, std::int64_t key_count,
          const InputRows& k) {
        float* out = scores + first * Bk + (key - block);
        const float* q_rows = t.q.data() + first * Dp;
        if (plan.bf16_pairs) {
          cpu::dot_rows_bf16_pairs(out, Bk, q_rows, Dp, count, k.rows, key_count, Dp, k.ahead);
        } else if (plan.int8_products) {
          const std::int64_t Dq = query_code_stride(p.head_dim);
          cpu::dot_rows_int8(out, Bk, t.q_codes.data() + first * Dq, Dq,
                             t.q_code_scales.data() + first, count, k.rows, key_count, p.head_dim,
                             k.ahead);
        } else {
          cpu::dot_rows(out, Bk, q_rows, Dp, count, k.rows, k.dtype, key_count, Dp, k.ahead);
        }
        if (k.scales) scale_columns(out, Bk, count, k.scales, key_count);
      });
  if (!p.modifiers.change_logits()) return;
  // The visible scores into logits; the masked ones stay -inf.
  for (std::int64_t slot_row = 0; slot_row < p.heads_kv * plan.rows; ++slot_row) {
    const std::int64_t r = slot_row % plan.rows, position = r % p.seqlen_q;
    const std::int64_t head = slot_row / plan.rows * p.group_size() + r / p.seqlen_q;
    const KeyRange seen = walk.range(position);
    const std::int64_t first = std::max(seen.begin, block);
    const std::int64_t last = std::min(seen.end, block + keys);
    if (first >= last) continue;
    cpu::modify_scores(scores + slot_row * Bk + (first - block), nullptr, last - first, p.scale,
                       cpu::row_modifiers(p, walk.batch_entry(), head, position, first,
                                          p.kv_length(walk.batch_entry())));
  }
}

// acc += p · v over the same keys in the same order.
void accumulate_step(const AttentionParams& p, const DecodePlan& plan, Scratch& t, KeyWalk& walk,
                     float* acc, std::int64_t block, std::int64_t keys) {
  const std::int64_t Bk = plan.block_keys, Dvp = cpu::pad_to_lanes(p.head_dim_v);
  float* scores = t.scores.data();
  walk.walk_inputs(p.v, p.v_strides, p.v_scale, p.head_dim_v, block, keys,
                   [&](std::int64_t first, std::int64_t count, std::int64_t key,
                       std::int64_t key_count, const InputRows& v) {
                     float* acc_rows = acc + first * Dvp;
                     float* weights = scores + first * Bk + (key - block);
                     // Each (row, key) weight comes once: scaled in place.
                     if (v.scales) scale_columns(weights, Bk, count, v.scales, key_count);
                     if (plan.bf16_pairs) {
                       cpu::axpy_rows_bf16_pairs(acc_rows, Dvp, weights, Bk, count, v.rows,
                                                 key_count, Dvp, v.ahead);
                     } else {
                       cpu::axpy_rows(acc_rows, Dvp, weights, Bk, count, v.rows, v.dtype, key_count,
                                      Dvp, v.ahead);
                     }
                   });
}

// One (batch entry, key chunk) task: every KV head's rows against the chunk's keys, a block of
// Bk keys at a time:
//   s = q·k, masked pairs -inf        scores_step       [Hkv·rows x Bk]
//     (then softcap, ALiBi of scale·s, when asked for)
//   online softmax                    online_softmax_tile, per KV head
//   acc += p·v                        accumulate_step   [Hkv·rows x Dvp]
void decode_chunk(const AttentionParams& p, const DecodePlan& plan, Scratch& t,
                  ChunkResults& results, std::int64_t b, std::int64_t chunk) {
  const ChunkState state = start_chunk(p, plan, results, b, chunk);
  if (state.keys.empty()) return;
  load_query_rows(p, plan, t, b);
  KeyWalk walk(p, plan, t, b, state.keys);
  const std::int64_t rows = plan.rows, Bk = plan.block_keys;
  const std::int64_t Dvp = cpu::pad_to_lanes(p.head_dim_v);
  for (std::int64_t block = state.keys.begin; block < state.keys.end; block += Bk) {
    const std::int64_t keys = std::min(Bk, state.keys.end - block);
    scores_step(p, plan, t, walk, block, keys);
    for (std::int64_t h = 0; h < p.heads_kv; ++h) {
      cpu::online_softmax_tile(t.scores.data() + h * rows * Bk, Bk, p.tile_scale(),
                               state.row_max + h * rows, state.row_sum + h * rows,
                               state.acc + h * rows * Dvp, Dvp, rows, cpu::pad_to_lanes(keys), Dvp);
    }
    accumulate_step(p, plan, t, walk, state.acc, block, keys);
  }
}

// The chunks of every row of (batch entry b, KV head h) merged into out and lse; `buffer`
// holds 2·Dvp floats and one per chunk of the entry: the merged row, the same in the order of the
// dims (bf16 pairs), and the chunks' weights.
void merge_chunks(const AttentionParams& p, const DecodePlan& plan, const ChunkResults& results,
                  float* buffer, std::int64_t b, std::int64_t h) {
  const std::int64_t rows = plan.rows, heads = p.heads_kv, Sq = p.seqlen_q;
  const EntryChunks& entry = plan.entries[b];
  const std::int64_t Dvp = cpu::pad_to_lanes(p.head_dim_v);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t position = r % Sq, head = h * p.group_size() + r / Sq;
    auto slot = [&](std::int64_t chunk) { return ((entry.first + chunk) * heads + h) * rows + r; };
    // A NaN chunk max (a NaN score) is passed over here; its NaN sum makes the row NaN below.
    float max = kNegativeInfinity;
    for (std::int64_t chunk = 0; chunk < entry.chunks; ++chunk) {
      max = results.max[slot(chunk)] > max ? results.max[slot(chunk)] : max;
    }
    float sum = 0.0f;
    float* out_row = buffer;
    float* weights = buffer + 2 * Dvp;
    std::fill_n(out_row, Dvp, 0.0f);
    // A chunk whose max is -inf gets weight 0 (or 1, when every chunk's is): not skipped, since
    // its l is NaN where a NaN score hid from the max, and 0·NaN keeps the row NaN.
    for (std::int64_t chunk = 0; chunk < entry.chunks; ++chunk) {
      const float chunk_max = results.max[slot(chunk)];
      weights[chunk] = chunk_max == max ? 1.0f : std::exp(p.tile_scale() * (chunk_max - max));
      sum += results.sum[slot(chunk)] * weights[chunk];
    }
    // The row's accumulators lie heads·rows·Dvp floats apart, one per chunk: one product over
    // them all rather than a call per chunk, each with its fixed cost (docs/tuning.md).
    cpu::axpy_rows(out_row, Dvp, weights, 0, 1,
                   {results.acc.data() + slot(0) * Dvp, heads * rows * Dvp}, DType::f32,
                   entry.chunks, Dvp);
    // As the tiled forward's epilogue (cpu::normalize_row): rows that see no key get 0 and -inf
    // (the sink); a row whose scores are all -inf gets 0/0 without a sink. (A bias or mask,
    // which can mask every key of a row, sends the call to the tiled forward.)
    const cpu::RowNormalizer normalizer =
        cpu::normalize_row(max == kNegativeInfinity ? kNegativeInfinity : p.tile_scale() * max, sum,
                           p.entry_key_range(b, position).empty(), cpu::sink_logit(p, head));
    for (std::int64_t d = 0; d < p.head_dim_v; ++d) out_row[d] *= normalizer.inverse_sum;
    if (plan.bf16_pairs) {
      cpu::from_bf16_pair_order(buffer + Dvp, out_row, Dvp);
      out_row = buffer + Dvp;
    }
    store_row_f32(p.out, p.q_dtype, p.out_strides.offset(b, position, head), out_row, p.head_dim_v);
    if (p.lse) p.lse[p.lse_index(b, head, position)] = normalizer.lse;
  }
}

}  // namespace

namespace cpu {

bool use_flash_decode(const AttentionParams& p) {
  if (p.seqlen_q == 0 || p.group_size() * p.seqlen_q > kMaxDecodeRows) return false;
  // A bias or mask masks keys inside a row's range, which this path's P·V would multiply by 0
  // (0·inf with a non-finite value): the tiled forward skips them.
  if (p.modifiers.masks_logits()) return false;
  // Dropout belongs to training, whose shapes the tiled forward serves.
  if (p.dropout.on()) return false;
  // The score tiles of every KV head, Bk = 16 keys at least, within the tiled forward's tile.
  const cpu::TileSizes tiles = cpu::flash_tiles(p.head_dim, p.head_dim_v);
  return p.heads_kv * p.group_size() * p.seqlen_q * cpu::kTileLanes <= tiles.rows * tiles.keys;
}

std::int64_t flash_decode_scratch_bytes(const AttentionParams& p) {
  const DecodePlan plan = decode_plan(p);
  const __int128 Dp = cpu::pad_to_lanes(p.head_dim), Dvp = cpu::pad_to_lanes(p.head_dim_v);
  const __int128 slots_per_entry = p.heads_kv * plan.rows;
  // The query codes of the integer products and their scales (2 bytes a code, counted as 4).
  const __int128 codes =
      plan.int8_products ? slots_per_entry * (query_code_stride(p.head_dim) + 1) : 0;
  const __int128 per_thread =
      slots_per_entry * (Dp + plan.block_keys) + plan.key_group * std::max(Dp, Dvp) + codes;
  const __int128 shared = static_cast<__int128>(plan.total_chunks) * slots_per_entry * (Dvp + 2);
  const __int128 bytes = (p.num_threads * per_thread + shared) * 4;
  return bytes > std::numeric_limits<std::int64_t>::max() ? std::numeric_limits<std::int64_t>::max()
                                                          : static_cast<std::int64_t>(bytes);
}

void flash_decode(const AttentionParams& p) {
  if (p.batch == 0) return;
  const DecodePlan plan = decode_plan(p);
  const std::int64_t Dp = cpu::pad_to_lanes(p.head_dim), Dvp = cpu::pad_to_lanes(p.head_dim_v);
  const std::int64_t slots_per_entry = p.heads_kv * plan.rows;
  const std::int64_t slots = plan.total_chunks * slots_per_entry;
  // Not zeroed here: start_chunk fills each chunk's slots before they are read.
  ChunkResults results{UninitializedAlignedVector<float>(slots),
                       UninitializedAlignedVector<float>(slots),
                       UninitializedAlignedVector<float>(slots * Dvp)};
  parallel_tasks(
      p.num_threads, plan.total_chunks,
      [&] {
        const std::int64_t codes = plan.int8_products ? slots_per_entry : 0;
        return Scratch{AlignedVector<float>(slots_per_entry * Dp),
                       -1,
                       AlignedVector<float>(slots_per_entry * plan.block_keys),
                       AlignedVector<float>(plan.key_group * std::max(Dp, Dvp)),
                       AlignedVector<std::int16_t>(codes * query_code_stride(p.head_dim)),
                       AlignedVector<float>(codes)};
      },
      [&](Scratch& t, std::int64_t task) {
        const std::int64_t chunk = plan.order[task];
        // The entry whose chunks hold this chunk: the last whose first chunk is <= chunk.
        const auto entry = std::upper_bound(plan.entries.begin(), plan.entries.end(), chunk,
                                            [](std::int64_t value, const EntryChunks& e) {
                                              return value < e.first;
                                            }) -
                           1;
        decode_chunk(p, plan, t, results, entry - plan.entries.begin(), chunk - entry->first);
      });
  std::int64_t max_entry_chunks = 0;
  for (const EntryChunks& entry : plan.entries) {
    max_entry_chunks = std::max(max_entry_chunks, entry.chunks);
  }
  parallel_tasks(
      p.num_threads, p.batch * p.heads_kv,
      [&] { return AlignedVector<float>(2 * Dvp + max_entry_chunks); },
      [&](AlignedVector<float>& buffer, std::int64_t task) {
        merge_chunks(p, plan, results, buffer.data(), task / p.heads_kv, task % p.heads_kv);
      });
}

}  // namespace cpu
}  // namespace flashattn::detail
