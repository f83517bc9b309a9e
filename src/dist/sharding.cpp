// Which rows of the whole sequence each rank holds (flashattn/dist.hpp), and copies between the
// whole tensor and a rank's shard.

#include <algorithm>
#include <cstring>
#include <string>

#include "api/fail.hpp"
#include "flashattn/dist.hpp"

namespace flashattn::dist {
namespace {

// Chunk c of `count` near-equal chunks of `seqlen` rows: the first seqlen % count chunks are one
// row longer.
Segment chunk(std::int64_t seqlen, std::int64_t count, std::int64_t c) {
  const std::int64_t base = seqlen / count, longer = seqlen % count;
  return {c * base + std::min(c, longer), base + (c < longer ? 1 : 0)};
}

void check_ranks(const char* caller, std::int64_t seqlen, int ranks, int rank) {
  if (ranks < 1) detail::fail(caller, "ranks: expected >= 1, got ", ranks);
  if (rank < 0 || rank >= ranks) {
    detail::fail(caller, "rank: expected 0..", ranks - 1, ", got ", rank);
  }
  if (seqlen < 0) detail::fail(caller, "seqlen: expected >= 0, got ", seqlen);
}

// Copies `rows` rows of every batch entry between two [batch, *, heads, dim] views, from row
// `from_row` of `from` to row `to_row` of `to`, one (batch, row, head) vector at a time.
void copy_rows(const ConstTensorView& from, std::int64_t from_row, const TensorView& to,
               std::int64_t to_row, std::int64_t rows) {
  const std::size_t bytes = static_cast<std::size_t>(from.shape[3]) * dtype_size(from.dtype);
  const std::int64_t element = static_cast<std::int64_t>(dtype_size(from.dtype));
  for (std::int64_t b = 0; b < from.shape[0]; ++b) {
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t h = 0; h < from.shape[2]; ++h) {
        const std::int64_t source =
            b * from.strides[0] + (from_row + i) * from.strides[1] + h * from.strides[2];
        const std::int64_t target =
            b * to.strides[0] + (to_row + i) * to.strides[1] + h * to.strides[2];
        std::memcpy(static_cast<char*>(to.data) + target * element,
                    static_cast<const char*>(from.data) + source * element, bytes);
      }
    }
  }
}

// The whole tensor and a shard must agree on batch, heads, dim and dtype, the shard holding the
// rank's rows; the last dims contiguous.
void check_views(const char* caller, const ConstTensorView& whole, const ConstTensorView& local,
                 Sharding sharding, int ranks, int rank) {
  check_ranks(caller, whole.shape[1], ranks, rank);
  for (int d = 0; d < 4; ++d) {
    if (whole.shape[d] < 0 || local.shape[d] < 0) {
      detail::fail(caller, "shapes: expected non-negative dims, got whole dim ", d, " = ",
                   whole.shape[d], ", local ", local.shape[d]);
    }
  }
  if (whole.dtype != local.dtype) {
    detail::fail(caller, "local: expected dtype ", dtype_name(whole.dtype), " (as whole), got ",
                 dtype_name(local.dtype));
  }
  const std::int64_t rows = shard_length(sharding, whole.shape[1], ranks, rank);
  if (local.shape[0] != whole.shape[0] || local.shape[1] != rows ||
      local.shape[2] != whole.shape[2] || local.shape[3] != whole.shape[3]) {
    detail::fail(caller, "local: expected shape [", whole.shape[0], ", ", rows, ", ",
                 whole.shape[2], ", ", whole.shape[3], "] (rank ", rank, "'s ",
                 sharding_name(sharding), " shard of ", whole.shape[1], " rows over ", ranks,
                 " ranks), got [", local.shape[0], ", ", local.shape[1], ", ", local.shape[2], ", ",
                 local.shape[3], "]");
  }
  if ((whole.shape[3] > 1 && whole.strides[3] != 1) ||
      (local.shape[3] > 1 && local.strides[3] != 1)) {
    detail::fail(caller, "views: expected the last dim contiguous (stride 1), got strides ",
                 whole.strides[3], " (whole) and ", local.strides[3], " (local)");
  }
}

}  // namespace

const char* sharding_name(Sharding sharding) {
  return sharding == Sharding::zigzag ? "zigzag" : "contiguous";
}

std::vector<Segment> shard_segments(Sharding sharding, std::int64_t seqlen, int ranks, int rank) {
  check_ranks("shard_segments", seqlen, ranks, rank);
  if (sharding == Sharding::contiguous) return {chunk(seqlen, ranks, rank)};
  const std::int64_t chunks = 2 * static_cast<std::int64_t>(ranks);
  return {chunk(seqlen, chunks, rank), chunk(seqlen, chunks, chunks - 1 - rank)};
}

std::int64_t shard_length(Sharding sharding, std::int64_t seqlen, int ranks, int rank) {
  std::int64_t rows = 0;
  for (const Segment& segment : shard_segments(sharding, seqlen, ranks, rank)) {
    rows += segment.length;
  }
  return rows;
}

void shard(const ConstTensorView& whole, Sharding sharding, int ranks, int rank,
           const TensorView& local) {
  check_views("shard", whole, local, sharding, ranks, rank);
  std::int64_t local_row = 0;
  for (const Segment& segment : shard_segments(sharding, whole.shape[1], ranks, rank)) {
    copy_rows(whole, segment.begin, local, local_row, segment.length);
    local_row += segment.length;
  }
}

void unshard(const ConstTensorView& local, Sharding sharding, int ranks, int rank,
             const TensorView& whole) {
  check_views("unshard", whole, local, sharding, ranks, rank);
  std::int64_t local_row = 0;
  for (const Segment& segment : shard_segments(sharding, whole.shape[1], ranks, rank)) {
    copy_rows(local, local_row, whole, segment.begin, segment.length);
    local_row += segment.length;
  }
}

}  // namespace flashattn::dist
