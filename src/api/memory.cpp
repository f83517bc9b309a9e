#include "api/memory.hpp"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <string>

#include "cpu/flash_decode.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/kernels/tile_kernels_amx.hpp"
#include "cpu/tile_sizes.hpp"

namespace flashattn::detail {
namespace {

constexpr std::int64_t kUnlimited = std::numeric_limits<std::int64_t>::max();

// The number in a cgroup limit file, or kUnlimited for "max", a missing file or anything else.
std::int64_t read_cgroup_limit(const char* path) {
  std::ifstream file(path);
  std::string text;
  if (!(file >> text) || text.empty() ||
      text.find_first_not_of("0123456789") != std::string::npos || text.size() > 18) {
    return kUnlimited;
  }
  return std::stoll(text);
}

std::int64_t saturate(__int128 bytes) {
  return bytes > kUnlimited ? kUnlimited : static_cast<std::int64_t>(bytes);
}

}  // namespace

std::int64_t memory_limit_bytes() {
  static const std::int64_t limit = [] {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page_size = ::sysconf(_SC_PAGESIZE);
    std::int64_t bytes = pages > 0 && page_size > 0
                             ? saturate(static_cast<__int128>(pages) * page_size)
                             : kUnlimited;
    // cgroup v2, then v1, as seen from inside a container.
    bytes = std::min(bytes, read_cgroup_limit("/sys/fs/cgroup/memory.max"));
    bytes = std::min(bytes, read_cgroup_limit("/sys/fs/cgroup/memory/memory.limit_in_bytes"));
    return bytes;
  }();
  return limit;
}

std::int64_t scratch_bytes(AttentionImpl impl, const AttentionParams& p) {
  const __int128 rows = static_cast<__int128>(p.batch) * p.heads_q * p.seqlen_q;
  if (rows == 0) return 0;
  // Bounded with the larger head dim for every operand (v's and out's may differ from q's and k's).
  const std::int64_t dims = std::max(p.head_dim, p.head_dim_v);
  const __int128 threads = p.num_threads, D = dims, Sq = p.seqlen_q, Skv = p.seqlen_kv;
  const __int128 D_padded = cpu::pad_to_lanes(dims);
  switch (impl) {
    case AttentionImpl::flash: {
      if (cpu::use_flash_decode(p)) return cpu::flash_decode_scratch_bytes(p);
      // Per thread: for each Q block of a task Q and accumulator tiles [rows x Dp], running
      // max and sum; packed K [D x Bc] and V [Bc x Dp], scores [rows x Bc]. A Q block holds at
      // least a whole GQA group.
      const cpu::TileSizes tiles = cpu::flash_tiles(p.head_dim, p.head_dim_v);
      const __int128 tile_rows = std::max(tiles.rows, p.group_size()), keys = tiles.keys;
      __int128 floats = tiles.blocks_per_task * (tile_rows * D_padded * 2 + 2 * tile_rows) +
                        D * keys + keys * D_padded + tile_rows * keys;
      if (p.dtype == DType::bf16) {
        // bf16 operands of the bf16 products beside them: Q, Kᵀ, V and P, two per float.
        const __int128 bf16_dims = cpu::pad_to_amx_reduction(D);
        const __int128 bf16_keys = cpu::pad_to_amx_reduction(tiles.keys);
        floats += (tiles.blocks_per_task * tile_rows * bf16_dims + keys * bf16_dims +
                   bf16_keys * D_padded + tile_rows * bf16_keys + 1) /
                  2;
      }
      // Key chunks: m, l and acc of every query row per chunk (flash_forward.cpp).
      const __int128 chunks = cpu::flash_forward_key_chunks(p);
      const __int128 partial =
          chunks > 1 ? chunks * rows * (cpu::pad_to_lanes(p.head_dim_v) + 2) : 0;
      return saturate((threads * floats + partial) * 4);
    }
    case AttentionImpl::standard: {
      // Per head in flight: the score matrix [Sq x pad(Skv)] and fp32 copies of q, k, v, out.
      const __int128 heads_in_flight =
          static_cast<__int128>(p.batch) * p.heads_q >= threads ? threads : 1;
      const __int128 floats = Sq * cpu::pad_to_lanes(p.seqlen_kv) + 2 * (Sq + Skv) * D;
      return saturate(heads_in_flight * floats * 4);
    }
    case AttentionImpl::reference: {
      // fp64 copies of out and lse, and one row of scores and one output row per thread.
      const __int128 doubles = rows * D + (p.lse ? rows : 0) + threads * (Skv + D);
      return saturate(doubles * 8);
    }
  }
  return 0;
}

std::int64_t backward_scratch_bytes(AttentionImpl impl, const BackwardParams& bp) {
  const AttentionParams& p = bp.forward;
  const __int128 rows = static_cast<__int128>(p.batch) * p.heads_q * p.seqlen_q;
  const __int128 kv_rows = static_cast<__int128>(p.batch) * p.heads_kv * p.seqlen_kv;
  if (rows == 0 && kv_rows == 0) return 0;
  // Bounded with the larger head dim for every operand (v's and out's may differ from q's and k's).
  const std::int64_t dims = std::max(p.head_dim, p.head_dim_v);
  const __int128 threads = p.num_threads, D = dims, Sq = p.seqlen_q, Skv = p.seqlen_kv;
  const __int128 D_padded = cpu::pad_to_lanes(dims);
  switch (impl) {
    case AttentionImpl::flash: {
      // Per thread the K and V panels, two score-sized tiles and dK, dV accumulators. The
      // query side (Q and dO packed in row blocks of Br, D_i, the dQ sums): with one chunk of
      // K/V blocks per group, per thread for one GQA group; with several, shared by all groups
      // with one dQ buffer per chunk.
      const cpu::TileSizes tiles = cpu::flash_backward_tiles(p);
      const __int128 tile_rows = tiles.rows, keys = tiles.keys;
      const __int128 padded_sq = (Sq + tile_rows - 1) / tile_rows * tile_rows;
      __int128 per_thread = 2 * D * keys + 4 * keys * D_padded + 2 * tile_rows * keys;
      // Dropout's mask and P ∘ M, two more score-sized tiles of rows Bc + one cache line.
      if (p.dropout.on()) per_thread += 2 * tile_rows * (keys + cpu::kTileLanes);
      __int128 shared = 0;
      const __int128 chunks = cpu::flash_backward_chunks(p);
      const __int128 groups = static_cast<__int128>(p.batch) * p.heads_kv;
      const __int128 group_rows = p.group_size();
      // bf16 inputs may add bf16 operands of the AMX products, two per float: Kᵀ and Vᵀ, K as
      // key pairs, Pᵀ, dSᵀ and dS; per query row Q and dO as rows and as row pairs.
      const bool bf16 = p.dtype == DType::bf16;
      const __int128 bf16_dims = bf16 ? cpu::pad_to_amx_reduction(D) : 0;
      if (bf16) {
        const __int128 amx_rows = cpu::pad_to_amx_reduction(tiles.rows);
        const __int128 amx_keys = cpu::pad_to_amx_reduction(tiles.keys);
        per_thread += keys * bf16_dims +
                      (amx_keys * D_padded + 2 * keys * amx_rows + tile_rows * amx_keys + 1) / 2;
      }
      const __int128 row_floats =
          padded_sq * (2 * D_padded + 1 + bf16_dims + (bf16 ? D_padded : 0));
      if (chunks == 1) {
        per_thread += group_rows * (row_floats + Sq * D_padded);
      } else {
        shared = groups * group_rows * (row_floats + chunks * Sq * D_padded);
      }
      // dbias: its fp64 sums, two floats per element of the bias, and one row of Bc per thread.
      if (bp.dbias.data != nullptr) {
        shared += 2 * static_cast<__int128>(bp.dbias.shape[0]) * bp.dbias.shape[1] * Sq * Skv;
        per_thread += keys;
      }
      return saturate((shared + threads * per_thread) * 4);
    }
    case AttentionImpl::standard: {
      // Per KV head in flight: P and dS [Sq x pad(Skv)] (and with dropout M and P ∘ M), dK, dV,
      // dQ, and fp32 copies.
      const __int128 score_matrices = p.dropout.on() ? 4 : 2;
      const __int128 per_task =
          score_matrices * Sq * cpu::pad_to_lanes(p.seqlen_kv) + 4 * Skv * D + 3 * Sq * D + 2 * Sq;
      return saturate(threads * per_task * 4);
    }
    case AttentionImpl::reference:
      // fp64 dQ, dK, dV, and two rows of probabilities per thread.
      return saturate(((rows + 2 * kv_rows) * D + threads * 2 * Skv) * 8);
  }
  return 0;
}

void check_scratch_fits(const char* caller, AttentionImpl impl, const AttentionParams& params,
                        std::int64_t needed) {
  const std::int64_t limit = memory_limit_bytes();
  if (needed > limit) {
    throw Error(std::string(caller) + ": expected a problem whose scratch memory fits in the " +
                std::to_string(limit) + " bytes of this machine, got one that needs " +
                (needed == kUnlimited ? std::string("more than 2^63") : std::to_string(needed)) +
                " bytes (" + impl_name(impl) + " path, batch " + std::to_string(params.batch) +
                ", seqlen_q " + std::to_string(params.seqlen_q) + ", seqlen_kv " +
                std::to_string(params.seqlen_kv) + ", heads_q " + std::to_string(params.heads_q) +
                ", head_dim " + std::to_string(params.head_dim) + ", head_dim_v " +
                std::to_string(params.head_dim_v) + ", " + std::to_string(params.num_threads) +
                " threads)");
  }
}

}  // namespace flashattn::detail

namespace flashattn {

std::int64_t score_buffer_bytes(AttentionImpl impl, std::int64_t seqlen_q, std::int64_t seqlen_kv,
                                std::int64_t head_dim, const AttentionOptions& options) {
  constexpr const char* caller = "score_buffer_bytes";
  for (const auto& [name, value] : {std::pair{"seqlen_q", seqlen_q}, {"seqlen_kv", seqlen_kv}}) {
    if (value < 0 || value > (std::int64_t{1} << 61)) {
      throw Error(std::string(caller) + ": " + name + ": expected 0..2^61, got " +
                  std::to_string(value));
    }
  }
  if (head_dim < 1 || head_dim > (std::int64_t{1} << 61)) {
    throw Error(std::string(caller) + ": head_dim: expected 1..2^61, got " +
                std::to_string(head_dim));
  }
  if (options.num_threads < 0) {
    throw Error(std::string(caller) + ": num_threads: expected >= 0 (0 = all), got " +
                std::to_string(options.num_threads));
  }
  const __int128 threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  __int128 bytes = 0;
  switch (impl) {
    case AttentionImpl::flash: {
      const detail::cpu::TileSizes tiles = detail::cpu::flash_tiles(head_dim, head_dim);
      bytes = threads * tiles.rows * tiles.keys * sizeof(float);
      break;
    }
    case AttentionImpl::standard:
      bytes = threads * seqlen_q * detail::cpu::pad_to_lanes(seqlen_kv) * sizeof(float);
      break;
    case AttentionImpl::reference:
      bytes = threads * seqlen_kv * sizeof(double);
      break;
  }
  if (bytes > std::numeric_limits<std::int64_t>::max()) {
    throw Error(std::string(caller) + ": seqlen_q " + std::to_string(seqlen_q) + " x seqlen_kv " +
                std::to_string(seqlen_kv) + " overflows a 64-bit byte count");
  }
  return static_cast<std::int64_t>(bytes);
}

}  // namespace flashattn
