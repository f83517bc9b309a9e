// Dealing a whole tensor's shards to the ranks and collecting them back, and timing one shift of
// a shard around the ring (flashattn/dist.hpp).

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "api/fail.hpp"
#include "dist/transport.hpp"
#include "flashattn/dist.hpp"

namespace flashattn::dist {
namespace {

constexpr int kTagShard = 4201;

struct Ranks {
  int rank = 0, count = 1;
};

Ranks ranks_of(MPI_Comm comm, const char* caller, int root) {
  if (comm == MPI_COMM_NULL) {
    flashattn::detail::fail(caller, "comm: expected a communicator, got MPI_COMM_NULL");
  }
  Ranks ranks;
  MPI_Comm_rank(comm, &ranks.rank);
  MPI_Comm_size(comm, &ranks.count);
  if (root < 0 || root >= ranks.count) {
    flashattn::detail::fail(caller, "root: expected 0..", ranks.count - 1, ", got ", root);
  }
  return ranks;
}

std::int64_t row_bytes(const char* caller, const std::array<std::int64_t, 4>& shape, DType dtype) {
  const std::int64_t bytes = shape[2] * shape[3] * static_cast<std::int64_t>(dtype_size(dtype));
  if (bytes > std::numeric_limits<int>::max()) {
    flashattn::detail::fail(
        caller, "heads x head_dim x element bytes: expected at most 2^31 - 1, got ", bytes);
  }
  return bytes;
}

// A contiguous [batch, rows, heads, dim] buffer of dtype.
struct Staging {
  std::unique_ptr<std::byte[]> bytes;
  TensorView view;

  Staging(DType dtype, std::array<std::int64_t, 4> shape) {
    const std::int64_t count = shape[0] * shape[1] * shape[2] * shape[3];
    bytes = std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(count) *
                                                        dtype_size(dtype));
    view = contiguous_view(bytes.get(), dtype, shape);
  }
};

std::array<std::int64_t, 4> shard_shape(const std::array<std::int64_t, 4>& whole, Sharding sharding,
                                        int ranks, int rank) {
  return {whole[0], shard_length(sharding, whole[1], ranks, rank), whole[2], whole[3]};
}

}  // namespace

void scatter_shards(MPI_Comm comm, int root, const ConstTensorView& whole, Sharding sharding,
                    const TensorView& local, double timeout_seconds) {
  constexpr const char* caller = "scatter_shards";
  const Ranks ranks = ranks_of(comm, caller, root);
  const transport::RowType row(row_bytes(caller, local.shape, local.dtype));
  const std::int64_t rows = local.shape[0] * local.shape[1];
  std::vector<MPI_Request> requests;
  if (ranks.rank == root) {
    // The root's own shard first: it checks whole and local before any message is posted.
    shard(whole, sharding, ranks.count, root, local);
    std::vector<Staging> outgoing;
    outgoing.reserve(static_cast<std::size_t>(ranks.count));
    for (int rank = 0; rank < ranks.count; ++rank) {
      if (rank == root) continue;
      outgoing.emplace_back(whole.dtype, shard_shape(whole.shape, sharding, ranks.count, rank));
      shard(whole, sharding, ranks.count, rank, outgoing.back().view);
      requests.emplace_back();
      MPI_Isend(outgoing.back().bytes.get(),
                static_cast<int>(outgoing.back().view.shape[0] * outgoing.back().view.shape[1]),
                row.get(), rank, kTagShard, comm, &requests.back());
    }
    transport::wait_bounded(requests, timeout_seconds, caller, ranks.rank,
                            "not every rank took its shard");
    return;
  }
  Staging incoming(local.dtype, local.shape);
  requests.emplace_back();
  MPI_Irecv(incoming.bytes.get(), static_cast<int>(rows), row.get(), root, kTagShard, comm,
            &requests.back());
  transport::wait_bounded(requests, timeout_seconds, caller, ranks.rank,
                          "no shard came from the root");
  // A plain copy into local's strides: the sharding of one rank is the whole.
  shard(incoming.view, Sharding::contiguous, 1, 0, local);
}

void gather_shards(MPI_Comm comm, int root, const ConstTensorView& local, Sharding sharding,
                   const TensorView& whole, double timeout_seconds) {
  constexpr const char* caller = "gather_shards";
  const Ranks ranks = ranks_of(comm, caller, root);
  const transport::RowType row(row_bytes(caller, local.shape, local.dtype));
  std::vector<MPI_Request> requests;
  if (ranks.rank != root) {
    Staging outgoing(local.dtype, local.shape);
    shard(local, Sharding::contiguous, 1, 0, outgoing.view);
    requests.emplace_back();
    MPI_Isend(outgoing.bytes.get(), static_cast<int>(local.shape[0] * local.shape[1]), row.get(),
              root, kTagShard, comm, &requests.back());
    transport::wait_bounded(requests, timeout_seconds, caller, ranks.rank,
                            "the root did not take this rank's shard");
    return;
  }
  // The root's own shard first: it checks local and whole before any message is posted.
  unshard(local, sharding, ranks.count, root, whole);
  std::vector<Staging> incoming;
  incoming.reserve(static_cast<std::size_t>(ranks.count));
  std::vector<int> sources;
  for (int rank = 0; rank < ranks.count; ++rank) {
    if (rank == root) continue;
    incoming.emplace_back(local.dtype, shard_shape(whole.shape, sharding, ranks.count, rank));
    sources.push_back(rank);
    requests.emplace_back();
    MPI_Irecv(incoming.back().bytes.get(),
              static_cast<int>(incoming.back().view.shape[0] * incoming.back().view.shape[1]),
              row.get(), rank, kTagShard, comm, &requests.back());
  }
  transport::wait_bounded(requests, timeout_seconds, caller, ranks.rank,
                          "not every rank sent its shard");
  for (std::size_t i = 0; i < incoming.size(); ++i) {
    unshard(incoming[i].view, sharding, ranks.count, sources[i], whole);
  }
}

double ring_shift_seconds(MPI_Comm comm, const ConstTensorView& k_local,
                          const ConstTensorView& v_local) {
  constexpr const char* caller = "ring_shift_seconds";
  const Ranks ranks = ranks_of(comm, caller, 0);
  if (ranks.count == 1) return 0.0;
  // K and V as the ring sends them, in one buffer; the previous rank's shard may be up to two rows
  // per batch entry longer (zig-zag), so the receive buffer has room for more.
  const std::array<std::int64_t, 4>& shape = k_local.shape;
  const std::int64_t rows = 2 * shape[0] * shape[1], capacity = rows + 4 * shape[0];
  const transport::RowType row(row_bytes(caller, shape, k_local.dtype));
  Staging send(k_local.dtype, {1, rows, shape[2], shape[3]});
  Staging receive(k_local.dtype, {1, capacity, shape[2], shape[3]});
  const std::int64_t k_bytes =
      k_local.numel() * static_cast<std::int64_t>(dtype_size(k_local.dtype));
  shard(k_local, Sharding::contiguous, 1, 0,
        contiguous_view(send.bytes.get(), k_local.dtype, shape));
  shard(v_local, Sharding::contiguous, 1, 0,
        contiguous_view(send.bytes.get() + k_bytes, k_local.dtype, shape));
  const int next = (ranks.rank + 1) % ranks.count;
  const int previous = (ranks.rank + ranks.count - 1) % ranks.count;
  double best = INFINITY;
  for (int trial = 0; trial < 3; ++trial) {
    MPI_Barrier(comm);
    const double start = MPI_Wtime();
    MPI_Sendrecv(send.bytes.get(), static_cast<int>(rows), row.get(), next, kTagShard,
                 receive.bytes.get(), static_cast<int>(capacity), row.get(), previous, kTagShard,
                 comm, MPI_STATUS_IGNORE);
    best = std::min(best, MPI_Wtime() - start);
  }
  return best;
}

}  // namespace flashattn::dist
