#pragma once

// Context parallelism: attention over a sequence split across the processes of an MPI
// communicator (ring attention). Each rank holds a shard of the rows of q, k and v; the K/V
// shards travel around the ring (rank r sends to r + 1) while every rank runs FlashAttention on
// the block it holds, and the partial results merge exactly by their log-sum-exp
// (flashattn/merge.hpp), the online softmax one level up. Built with FLASHATTN_MPI; link
// flashattn::dist. docs/dist.md has the algorithm, the byte counts and the figures.

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/error.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::dist {

// How the seqlen rows of the whole sequence are dealt to the ranks.
//   contiguous  rank r holds the r-th of P near-equal chunks. Under a causal mask rank r then
//               does r + 1 blocks of work and the last rank P times the first's.
//   zigzag      the sequence in 2P near-equal chunks; rank r holds chunks r and 2P − 1 − r, in
//               that order, so that under a causal mask every rank does the same work.
enum class Sharding { contiguous, zigzag };

const char* sharding_name(Sharding sharding);

// A run of consecutive rows of the whole sequence that a rank holds: global rows
// [begin, begin + length). A rank's local rows are its segments one after the other.
struct Segment {
  std::int64_t begin = 0, length = 0;
};

// The segments of `rank` (one for contiguous, two for zigzag; some may be empty when seqlen is
// small), and the local length they add up to. ranks >= 1, 0 <= rank < ranks, seqlen >= 0.
std::vector<Segment> shard_segments(Sharding sharding, std::int64_t seqlen, int ranks, int rank);
std::int64_t shard_length(Sharding sharding, std::int64_t seqlen, int ranks, int rank);

// Copies rank `rank`'s rows (dim 1) of a whole [batch, seqlen, heads, dim] tensor into `local`
// [batch, shard_length, heads, dim], and back. Same dtype; any strides, last dim contiguous.
void shard(const ConstTensorView& whole, Sharding sharding, int ranks, int rank,
           const TensorView& local);
void unshard(const ConstTensorView& local, Sharding sharding, int ranks, int rank,
             const TensorView& whole);

// Raised on a rank that cannot go on with a ring call once it has begun: a peer's message did not
// come within RingOptions::timeout_seconds (a rank died or stopped calling), or this rank failed
// mid-call (out of memory). Unlike the validation errors, which every rank raises alike, this one
// is this rank's alone: its peers are left waiting (until their own timeout), and the
// communicator is unusable. The usual answer is MPI_Abort.
class RingAborted : public Error {
 public:
  using Error::Error;
};

// Rank `root` deals every rank of `comm` its shard of a whole [batch, seqlen, heads, dim] tensor,
// and back. Collective. On root, `whole` is read (scatter) or written (gather); the other ranks
// pass a view whose shape alone is read (data may be null). `local` on each rank is
// [batch, shard_length(sharding, seqlen, ranks, rank), heads, dim] in whole's dtype; any
// strides, last dim contiguous. Every wait is bounded by timeout_seconds (RingAborted).
void scatter_shards(MPI_Comm comm, int root, const ConstTensorView& whole, Sharding sharding,
                    const TensorView& local, double timeout_seconds = 300.0);
void gather_shards(MPI_Comm comm, int root, const ConstTensorView& local, Sharding sharding,
                   const TensorView& whole, double timeout_seconds = 300.0);

// Seconds that one shift of this rank's K and V shard to the next rank takes with nothing else
// running (the fastest of three, after a barrier): the transfer time that the ring's compute
// has to hide. Collective; 0 on a communicator of one.
double ring_shift_seconds(MPI_Comm comm, const ConstTensorView& k_local,
                          const ConstTensorView& v_local);

struct RingOptions {
  Sharding sharding = Sharding::contiguous;
  // The longest wait for a peer's message before the call gives up with an Error (a rank that
  // died or stopped calling): every wait is bounded.
  double timeout_seconds = 300.0;
};

// What one call did on this rank, for reports (flashattn ring prints it).
struct RingStats {
  double seconds = 0.0;          // the whole call
  double compute_seconds = 0.0;  // inside attention and merge calls
  // The compute thread's waits for a transfer still running after its block was done: the
  // communication that was not hidden behind compute.
  double exposed_seconds = 0.0;
  double transfer_seconds = 0.0;  // the transfers themselves, from post to completion
  std::int64_t bytes_sent = 0;
  int blocks_computed = 0;  // (query segment, key segment) pairs attended
  int blocks_skipped = 0;   // pairs the mask hides entirely: neither computed nor sent for
};

// Shapes on each rank, as the single-process forward (attention.hpp) with seqlen the rank's
// shard_length of the whole sequence's S (the sum over ranks, Sq = Skv = S):
//   q_local            [batch, n, heads_q, head_dim]
//   k_local            [batch, n, heads_kv, head_dim]
//   v_local            [batch, n, heads_kv, head_dim_v]   (head_dim_v: attention.hpp)
//   out_local          [batch, n, heads_q, head_dim_v]
//   lse_local          fp32 contiguous [batch, heads_q, n], or null
// The causal mask, window and ALiBi act on global positions. Bias, mask and sinks are refused.
// A collective call: every rank of `comm` calls it with the same options. Invalid arguments on
// any rank raise the same flashattn::Error on every rank before any message moves. The merge runs
// in fp32; f16 and bf16 partial outputs are rounded once to their dtype before it (docs/dist.md).
// With MPI_THREAD_SERIALIZED or more the transfers run on a second thread, overlapped with the
// compute; otherwise they progress between blocks.
RingStats ring_attention_forward(MPI_Comm comm, const ConstTensorView& q_local,
                                 const ConstTensorView& k_local, const ConstTensorView& v_local,
                                 const TensorView& out_local, float* lse_local,
                                 const AttentionOptions& options = {},
                                 const RingOptions& ring = {});

// Gradients, with out_local and lse_local (required) as the forward wrote them. dk and dv of a
// K/V shard travel the ring with it, gathering every rank's share, and return to their owner.
// dq_local like q_local; dk_local like k_local, dv_local like v_local. Written once, not added to.
RingStats ring_attention_backward(MPI_Comm comm, const ConstTensorView& dout_local,
                                  const ConstTensorView& q_local, const ConstTensorView& k_local,
                                  const ConstTensorView& v_local, const ConstTensorView& out_local,
                                  const float* lse_local, const TensorView& dq_local,
                                  const TensorView& dk_local, const TensorView& dv_local,
                                  const AttentionOptions& options = {},
                                  const RingOptions& ring = {});

}  // namespace flashattn::dist
