// Ring attention over MPI (flashattn/dist.hpp).
//
// P ranks, each holding n ≈ S/P rows of q, k and v. At step t (0 ≤ t < P) rank r holds the K/V
// shard of rank s = r − t (mod P): it attends its query segments to that shard's key segments
// (api/block_attention.hpp puts each block on the whole sequence's diagonal) and merges the
// partial (out, lse) into its running state, while the shard moves on to rank r + 1 for step
// t + 1. Bytes per step and rank: 2·B·n·Hkv·D·elem sent and received, against 4·B·n²·Hq·D FLOPs
// of compute: at S = 32768, Hq = Hkv = 8, D = 128, P = 2 one step computes for ~6 s on a core and
// shifts its shard through shared memory in ~19 ms, which is what lets the transfer hide.
//
// A shard that no later rank of the ring needs (the causal mask hides it from all of them) is
// not sent on, and a (query segment, key segment) pair that the mask hides entirely is not
// computed. The backward sends K/V the same way; the shard's dK/dV accumulators (fp32) follow
// one step behind, so that they too move while the next block is computed, and go back to
// their owner from the last rank that needed the shard.
//
// Transfers run on a helper thread when the MPI library allows MPI_THREAD_SERIALIZED (the
// compute thread makes no MPI call while it runs); otherwise the compute thread posts them and
// they progress between blocks. Every wait is bounded by RingOptions::timeout_seconds.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "api/block_attention.hpp"
#include "api/fail.hpp"
#include "api/params.hpp"
#include "dist/transport.hpp"
#include "flashattn/dist.hpp"
#include "flashattn/merge.hpp"
#include "util/convert.hpp"

namespace flashattn::dist {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The ring's blocks are keyed by their place in the whole sequence; dropout's mask is not (yet).
void refuse_dropout(const char* caller, const AttentionOptions& options) {
  if (options.dropout_p != 0.0f) {
    detail::fail(caller, "dropout_p: expected 0, as ring attention has no dropout, got ",
                 options.dropout_p);
  }
}

constexpr int kTagKeysValues = 4101;
constexpr int kTagGradients = 4102;
constexpr int kTagFinalGradients = 4103;
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Agreement between ranks: every rank raises the same Error, or none does.

constexpr int kMessageBytes = 1024;

// Waits for a non-blocking collective that every rank must join.
void wait_for_all(MPI_Request& request, double timeout_seconds, const char* caller, int rank) {
  std::vector<MPI_Request> requests{request};
  transport::wait_bounded(requests, timeout_seconds, caller, rank,
                          "the ranks did not all join the call");
  request = requests[0];
}

// Raises, on every rank, the error of the lowest rank that has one (local_error non-empty).
void raise_first_error(MPI_Comm comm, const char* caller, const std::string& local_error,
                       double timeout_seconds) {
  int ranks = 0, rank = 0;
  MPI_Comm_size(comm, &ranks);
  MPI_Comm_rank(comm, &rank);
  const int mine = local_error.empty() ? ranks : rank;
  int first = ranks;
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm, &request);
  wait_for_all(request, timeout_seconds, caller, rank);
  if (first == ranks) return;
  char message[kMessageBytes] = {};
  if (rank == first) {
    std::strncpy(message, local_error.c_str(), kMessageBytes - 1);
  }
  MPI_Ibcast(message, kMessageBytes, MPI_CHAR, first, comm, &request);
  wait_for_all(request, timeout_seconds, caller, rank);
  throw Error(std::string(caller) + ": rank " + std::to_string(first) + ": " + message);
}

// What every rank must agree on, and each rank's own row count.
struct Descriptor {
  std::int64_t rows, batch, heads_q, heads_kv, head_dim, head_dim_v, dtype, causal, window_left,
      window_right, sharding, alibi_slopes;
  float scale, softcap;
};

// ---------------------------------------------------------------------------------------------
// The ring's plan: who holds which rows, which blocks the mask leaves visible, where shards go.

struct Plan {
  int ranks = 1, rank = 0;
  std::int64_t seqlen = 0;
  bool causal = false;
  std::int64_t left_reach = 0, right_reach = 0;  // keys a row sees either side of its diagonal
  std::vector<std::vector<Segment>> segments;    // [rank] global rows, local order
  std::vector<std::int64_t> rows;                // [rank] local rows

  Plan(int ranks_, int rank_, std::int64_t seqlen_, Sharding sharding,
       const AttentionOptions& options)
      : ranks(ranks_), rank(rank_), seqlen(seqlen_), causal(options.causal) {
    left_reach = options.window_left >= 0 ? std::min(options.window_left, seqlen) : seqlen;
    right_reach = causal                      ? 0
                  : options.window_right >= 0 ? std::min(options.window_right, seqlen)
                                              : seqlen;
    for (int r = 0; r < ranks; ++r) {
      segments.push_back(shard_segments(sharding, seqlen, ranks, r));
      rows.push_back(shard_length(sharding, seqlen, ranks, r));
    }
  }

  // Whether some row of query segment q sees some key of key segment k: rows x ≥ k.begin −
  // right_reach see past the segment's start, rows x < k.end + left_reach before its end, and
  // the two row sets are a suffix and a prefix of q.
  bool visible(const Segment& q, const Segment& k) const {
    if (q.length == 0 || k.length == 0) return false;
    const std::int64_t first = std::max(q.begin, k.begin - right_reach);
    const std::int64_t last = std::min(q.begin + q.length - 1, k.begin + k.length - 1 + left_reach);
    return first <= last;
  }

  bool needs(int reader, int owner) const {
    for (const Segment& q : segments[reader]) {
      for (const Segment& k : segments[owner]) {
        if (visible(q, k)) return true;
      }
    }
    return false;
  }

  int at(int owner, int step) const { return (owner + step) % ranks; }
  int owner_at(int step) const { return ((rank - step) % ranks + ranks) % ranks; }

  // Whether owner's shard, at rank owner + step after `step` steps, is sent on: some rank that
  // it would reach later needs it.
  bool sent_on(int owner, int step) const {
    for (int later = step + 1; later < ranks; ++later) {
      if (needs(at(owner, later), owner)) return true;
    }
    return false;
  }
  bool held(int owner, int step) const { return step == 0 || sent_on(owner, step - 1); }
  // The last step at which some rank holds owner's shard.
  int last_step(int owner) const {
    int step = 0;
    while (step + 1 < ranks && sent_on(owner, step)) ++step;
    return step;
  }
  int next() const { return (rank + 1) % ranks; }
  int previous() const { return (rank + ranks - 1) % ranks; }
};

// ---------------------------------------------------------------------------------------------
// One step's messages, bounded waits, on a helper thread when MPI allows.

class Transfers {
 public:
  Transfers(MPI_Comm comm, bool threaded, double timeout_seconds, const char* caller, int rank)
      : comm_(comm), threaded_(threaded), timeout_(timeout_seconds), caller_(caller), rank_(rank) {}
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;
  ~Transfers() {
    if (helper_.joinable()) helper_.join();
  }

  void send(const void* data, std::int64_t count, MPI_Datatype type, int to, int tag) {
    messages_.push_back({const_cast<void*>(data), count, type, to, tag, true});
  }
  void receive(void* data, std::int64_t count, MPI_Datatype type, int from, int tag) {
    messages_.push_back({data, count, type, from, tag, false});
  }

  // Posts the messages added since the last finish(). Everything the helper thread would
  // allocate is allocated here, on the calling thread, where a failure is an exception the call
  // turns into an Error; the helper itself allocates only for a timeout's message, and a failure
  // there is kept for finish() to raise (an exception leaving a std::thread ends the process).
  void start() {
    started_ = Clock::now();
    if (messages_.empty()) return;
    requests_.reserve(messages_.size());
    if (threaded_) {
      helper_ = std::thread([this] {
        try {
          post_and_wait();
        } catch (const std::bad_alloc&) {
          helper_out_of_memory_ = true;
        }
      });
    } else {
      post();
    }
  }

  // Lets posted messages progress (without a helper thread only; MPI_Testall moves them on).
  void progress() {
    if (threaded_ || requests_.empty()) return;
    int done = 0;
    MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE);
  }

  // Waits for every posted message; returns the seconds waited here. Throws Error after the
  // timeout.
  double finish() {
    const Clock::time_point waiting = Clock::now();
    if (messages_.empty()) return 0.0;
    if (threaded_) {
      helper_.join();
    } else {
      wait();
    }
    const double waited = seconds_since(waiting);
    transfer_seconds += transfer_;
    messages_.clear();
    requests_.clear();
    if (helper_out_of_memory_) {
      throw RingAborted(std::string(caller_) + ": rank " + std::to_string(rank_) +
                        ": out of memory (in the transfer thread)");
    }
    if (!error_.empty()) throw RingAborted(error_);
    return waited;
  }

  double transfer_seconds = 0.0;
  std::int64_t bytes_sent = 0;

 private:
  struct Message {
    void* data;
    std::int64_t count;
    MPI_Datatype type;
    int peer, tag;
    bool is_send;
  };

  void post() {
    for (const Message& m : messages_) {
      MPI_Request request = MPI_REQUEST_NULL;
      if (m.is_send) {
        MPI_Isend(m.data, static_cast<int>(m.count), m.type, m.peer, m.tag, comm_, &request);
        int size = 0;
        MPI_Type_size(m.type, &size);
        bytes_sent += m.count * size;
      } else {
        MPI_Irecv(m.data, static_cast<int>(m.count), m.type, m.peer, m.tag, comm_, &request);
      }
      requests_.push_back(request);
    }
  }

  // Polls until every request completes or the timeout passes; sleeps between polls once the
  // transfer has run for a while, so that a waiting helper does not take a core from the
  // compute threads.
  void wait() {
    int done = 0;
    for (int polls = 0;; ++polls) {
      MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE);
      if (done) break;
      if (seconds_since(started_) > timeout_) {
        std::string peers;
        for (const Message& m : messages_) {
          if (!m.is_send) peers += (peers.empty() ? "" : ", ") + std::to_string(m.peer);
        }
        error_ =
            std::string(caller_) + ": rank " + std::to_string(rank_) +
            ": a transfer did not complete within timeout_seconds = " + std::to_string(timeout_) +
            " (waiting on rank " + peers + "; a rank died or stopped calling)";
        break;
      }
      if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    transfer_ = seconds_since(started_);
  }

  void post_and_wait() {
    post();
    wait();
  }

  MPI_Comm comm_;
  bool threaded_;
  double timeout_;
  const char* caller_;
  int rank_;
  std::vector<Message> messages_;
  std::vector<MPI_Request> requests_;
  std::thread helper_;
  Clock::time_point started_;
  double transfer_ = 0.0;
  std::string error_;
  bool helper_out_of_memory_ = false;  // written by the helper, read after join()
};

// ---------------------------------------------------------------------------------------------
// Views and buffers.

// A contiguous buffer of one dtype seen as [batch, rows, heads, dim] blocks.
// Left uninitialized unless asked (a shard buffer is written whole before it is read; at
// S = 32768 a memset of every buffer cost ~7% of a call).
struct Buffer {
  std::unique_ptr<std::byte[]> bytes;
  DType dtype = DType::f32;

  void reserve(DType type, std::int64_t elements) {
    dtype = type;
    bytes = std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(elements) *
                                                        dtype_size(type));
  }
  void reserve_zeroed(DType type, std::int64_t elements) {
    dtype = type;
    bytes = std::make_unique<std::byte[]>(static_cast<std::size_t>(elements) * dtype_size(type));
  }
  void* at(std::int64_t element) {
    return bytes.get() + element * static_cast<std::int64_t>(dtype_size(dtype));
  }
  TensorView view(std::int64_t element, std::array<std::int64_t, 4> shape) {
    return contiguous_view(at(element), dtype, shape);
  }
  float* floats() { return reinterpret_cast<float*>(bytes.get()); }
};

// Copies a [batch, rows, heads, dim] view into contiguous memory at `to` (same dtype).
void pack(const ConstTensorView& from, void* to) {
  const std::int64_t element = static_cast<std::int64_t>(dtype_size(from.dtype));
  const std::size_t vector_bytes = static_cast<std::size_t>(from.shape[3] * element);
  char* target = static_cast<char*>(to);
  for (std::int64_t b = 0; b < from.shape[0]; ++b) {
    for (std::int64_t s = 0; s < from.shape[1]; ++s) {
      for (std::int64_t h = 0; h < from.shape[2]; ++h) {
        const std::int64_t offset = b * from.strides[0] + s * from.strides[1] + h * from.strides[2];
        std::memcpy(target, static_cast<const char*>(from.data) + offset * element, vector_bytes);
        target += vector_bytes;
      }
    }
  }
}

// to (any dtype, any strides) = from (fp32, contiguous, same shape).
void store(const float* from, const TensorView& to) {
  for (std::int64_t b = 0; b < to.shape[0]; ++b) {
    for (std::int64_t s = 0; s < to.shape[1]; ++s) {
      for (std::int64_t h = 0; h < to.shape[2]; ++h) {
        detail::store_row_f32(to.data, to.dtype,
                              b * to.strides[0] + s * to.strides[1] + h * to.strides[2], from,
                              to.shape[3]);
        from += to.shape[3];
      }
    }
  }
}

// to (fp32) += from (contiguous, any dtype), count elements; fp32 in a loop the compiler
// vectorizes.
void add_to(float* to, const void* from, DType dtype, std::int64_t count) {
  if (dtype == DType::f32) {
    const float* values = static_cast<const float*>(from);
    for (std::int64_t i = 0; i < count; ++i) to[i] += values[i];
    return;
  }
  for (std::int64_t i = 0; i < count; ++i) to[i] += load_f32(from, dtype, i);
}

// ---------------------------------------------------------------------------------------------
// The call's shared set-up: validation that agrees across ranks, the plan, the thread mode.

struct Setup {
  int ranks = 1, rank = 0;
  std::int64_t batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  DType dtype = DType::f32;
  bool threaded = false;
  Plan plan;
};

Setup agree(MPI_Comm comm, const char* caller, const ConstTensorView& q, const ConstTensorView& k,
            const ConstTensorView& v, const AttentionOptions& options, const RingOptions& ring,
            const std::string& local_error_in) {
  if (comm == MPI_COMM_NULL)
    detail::fail(caller, "comm: expected a communicator, got MPI_COMM_NULL");
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    detail::fail(caller, "MPI: expected an initialized, not finalized MPI library");
  }
  Setup setup{.plan = Plan(1, 0, 0, Sharding::contiguous, {})};
  MPI_Comm_size(comm, &setup.ranks);
  MPI_Comm_rank(comm, &setup.rank);

  std::string local_error = local_error_in;
  if (local_error.empty() && q.shape[1] != k.shape[1]) {
    local_error = "k_local: expected " + std::to_string(q.shape[1]) +
                  " rows (as q_local: a rank holds the same rows of q, k and v), got " +
                  std::to_string(k.shape[1]);
  }
  if (local_error.empty() &&
      (options.bias.data != nullptr || options.mask.data != nullptr || !options.sinks.empty())) {
    local_error =
        "options: expected no bias, mask or sinks (ring attention does not take them), got one";
  }
  if (local_error.empty() && !(ring.timeout_seconds > 0.0 && std::isfinite(ring.timeout_seconds))) {
    local_error =
        "timeout_seconds: expected a finite value > 0, got " + std::to_string(ring.timeout_seconds);
  }
  if (local_error.empty() &&
      (ring.sharding != Sharding::contiguous && ring.sharding != Sharding::zigzag)) {
    local_error = "sharding: expected contiguous or zigzag";
  }
  // An invalid timeout is reported like any other error, after waits bounded by the default.
  const double timeout = local_error.empty() ? ring.timeout_seconds : RingOptions{}.timeout_seconds;
  raise_first_error(comm, caller, local_error, timeout);

  const Descriptor mine{q.shape[1],
                        q.shape[0],
                        q.shape[2],
                        k.shape[2],
                        q.shape[3],
                        v.shape[3],
                        static_cast<std::int64_t>(q.dtype),
                        options.causal ? 1 : 0,
                        options.window_left,
                        options.window_right,
                        static_cast<std::int64_t>(ring.sharding),
                        static_cast<std::int64_t>(options.alibi_slopes.size()),
                        options.softmax_scale.value_or(0.0f),
                        options.softcap};
  std::vector<Descriptor> all(static_cast<std::size_t>(setup.ranks));
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Iallgather(&mine, sizeof(Descriptor), MPI_BYTE, all.data(), sizeof(Descriptor), MPI_BYTE,
                 comm, &request);
  wait_for_all(request, timeout, caller, setup.rank);
  // Every rank checks the gathered descriptors the same way, so a mismatch raises the same Error
  // everywhere.
  std::int64_t seqlen = 0;
  for (const Descriptor& d : all) seqlen += d.rows;
  const Descriptor& first = all[0];
  for (int r = 1; r < setup.ranks; ++r) {
    const Descriptor& d = all[static_cast<std::size_t>(r)];
    const auto differ = [&](const char* what, auto ours, auto theirs) {
      if (ours != theirs) {
        detail::fail(caller, "rank ", r, ": expected ", what, " ", theirs, " (as rank 0), got ",
                     ours);
      }
    };
    differ("batch", d.batch, first.batch);
    differ("heads_q", d.heads_q, first.heads_q);
    differ("heads_kv", d.heads_kv, first.heads_kv);
    differ("head_dim", d.head_dim, first.head_dim);
    differ("head_dim_v", d.head_dim_v, first.head_dim_v);
    differ("dtype (index)", d.dtype, first.dtype);
    differ("options.causal", d.causal, first.causal);
    differ("options.window_left", d.window_left, first.window_left);
    differ("options.window_right", d.window_right, first.window_right);
    differ("options.softmax_scale (0 = default)", d.scale, first.scale);
    differ("options.softcap", d.softcap, first.softcap);
    differ("options.alibi_slopes (count)", d.alibi_slopes, first.alibi_slopes);
    differ("sharding (index)", d.sharding, first.sharding);
  }
  for (int r = 0; r < setup.ranks; ++r) {
    const std::int64_t expected = shard_length(ring.sharding, seqlen, setup.ranks, r);
    if (all[static_cast<std::size_t>(r)].rows != expected) {
      detail::fail(caller, "rank ", r, ": expected ", expected, " rows (its ",
                   sharding_name(ring.sharding), " shard of ", seqlen, " rows over ", setup.ranks,
                   " ranks), got ", all[static_cast<std::size_t>(r)].rows);
    }
  }
  setup.batch = q.shape[0];
  setup.heads_q = q.shape[2];
  setup.heads_kv = k.shape[2];
  setup.head_dim = q.shape[3];
  setup.head_dim_v = v.shape[3];
  setup.dtype = q.dtype;
  const std::int64_t row_bytes = setup.heads_kv * (setup.head_dim + setup.head_dim_v) *
                                 static_cast<std::int64_t>(sizeof(float));
  if (row_bytes > std::numeric_limits<int>::max()) {
    detail::fail(caller,
                 "k_local: expected heads_kv x (head_dim + head_dim_v) x 4 bytes within MPI's int "
                 "count, got ",
                 row_bytes);
  }
  int thread_level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&thread_level);
  setup.threaded = thread_level >= MPI_THREAD_SERIALIZED;
  setup.plan = Plan(setup.ranks, setup.rank, seqlen, ring.sharding, options);
  return setup;
}

// Elements of `rows` rows of a shard's K, of its V, and of both: a shard travels as one buffer,
// K [batch, rows, heads_kv, head_dim] then V [batch, rows, heads_kv, head_dim_v], and its messages
// count (K row, V row) pairs, batch · rows of them (row_pair_bytes each).
std::int64_t key_elements(const Setup& s, std::int64_t rows) {
  return s.batch * rows * s.heads_kv * s.head_dim;
}
std::int64_t shard_elements(const Setup& s, std::int64_t rows) {
  return s.batch * rows * s.heads_kv * (s.head_dim + s.head_dim_v);
}
std::int64_t row_pair_bytes(const Setup& s, std::size_t element_bytes) {
  return s.heads_kv * (s.head_dim + s.head_dim_v) * static_cast<std::int64_t>(element_bytes);
}

struct ShardView {
  ConstTensorView k, v;
};
ShardView shard_view(const Setup& s, Buffer& buffer, std::int64_t rows) {
  return {buffer.view(0, {s.batch, rows, s.heads_kv, s.head_dim}),
          buffer.view(key_elements(s, rows), {s.batch, rows, s.heads_kv, s.head_dim_v})};
}

// The local rows at which each of `owner`'s segments starts.
std::vector<std::int64_t> local_offsets(const Plan& plan, int owner) {
  std::vector<std::int64_t> offsets;
  std::int64_t row = 0;
  for (const Segment& segment : plan.segments[static_cast<std::size_t>(owner)]) {
    offsets.push_back(row);
    row += segment.length;
  }
  return offsets;
}

// What a local check raised, or empty.
template <class Check>
std::string error_of(Check&& check) {
  try {
    check();
  } catch (const Error& error) {
    return error.what();
  }
  return {};
}

// Runs the part of a call after the ranks agreed: any failure there is this rank's alone.
template <class Body>
RingStats after_agreement(const char* caller, int rank, Body&& body) {
  try {
    return body();
  } catch (const RingAborted&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw RingAborted(std::string(caller) + ": rank " + std::to_string(rank) + ": out of memory");
  } catch (const std::exception& error) {
    throw RingAborted(std::string(caller) + ": rank " + std::to_string(rank) + ": " + error.what());
  }
}

// The whole call: a std::bad_alloc before the agreement (validation's small buffers) is an
// Error like any other local one.
// Calls visit(i, j) for each query segment i of this rank and key segment j of owner's shard
// that the mask leaves visible; counts the pairs it hides entirely in stats.blocks_skipped.
template <class Visit>
void for_each_visible_pair(const Plan& plan, int owner, RingStats& stats, Visit&& visit) {
  const std::vector<Segment>& queries = plan.segments[static_cast<std::size_t>(plan.rank)];
  const std::vector<Segment>& keys = plan.segments[static_cast<std::size_t>(owner)];
  for (std::size_t i = 0; i < queries.size(); ++i) {
    for (std::size_t j = 0; j < keys.size(); ++j) {
      if (queries[i].length == 0 || keys[j].length == 0) continue;
      if (!plan.visible(queries[i], keys[j])) {
        ++stats.blocks_skipped;
        continue;
      }
      visit(i, j);
    }
  }
}

// A step's K/V messages: the shard in hand on to the next rank when a later rank needs it, the
// next one in from the previous rank when it comes.
void move_shards(Transfers& transfers, const Setup& s, int step, Buffer& current, Buffer& incoming,
                 MPI_Datatype row_type) {
  const Plan& plan = s.plan;
  const int owner = plan.owner_at(step);
  if (plan.held(owner, step) && plan.sent_on(owner, step)) {
    transfers.send(current.at(0), s.batch * plan.rows[static_cast<std::size_t>(owner)], row_type,
                   plan.next(), kTagKeysValues);
  }
  const int arriving = plan.owner_at(step + 1);
  if (step + 1 < s.ranks && plan.sent_on(arriving, step)) {
    transfers.receive(incoming.at(0), s.batch * plan.rows[static_cast<std::size_t>(arriving)],
                      row_type, plan.previous(), kTagKeysValues);
  }
}

template <class Body>
RingStats run_collective(const char* caller, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    throw Error(std::string(caller) + ": out of memory");
  }
}

}  // namespace

RingStats ring_attention_forward(MPI_Comm comm, const ConstTensorView& q_local,
                                 const ConstTensorView& k_local, const ConstTensorView& v_local,
                                 const TensorView& out_local, float* lse_local,
                                 const AttentionOptions& options, const RingOptions& ring) {
  constexpr const char* caller = "ring_attention_forward";
  return run_collective(caller, [&] {
    const Clock::time_point call_start = Clock::now();
    const std::string local_error = error_of([&] {
      detail::make_params(caller, q_local, k_local, v_local, out_local, lse_local, options);
      refuse_dropout(caller, options);
    });
    const Setup s = agree(comm, caller, q_local, k_local, v_local, options, ring, local_error);
    return after_agreement(caller, s.rank, [&] {
      const Plan& plan = s.plan;
      RingStats stats;

      // Two shard buffers: the one computed on and the one being received into.
      const std::int64_t max_rows = *std::max_element(plan.rows.begin(), plan.rows.end());
      Buffer shards[2];
      for (Buffer& buffer : shards) buffer.reserve(s.dtype, shard_elements(s, max_rows));
      const std::int64_t own_rows = plan.rows[static_cast<std::size_t>(s.rank)];
      pack(k_local, shards[0].at(0));
      pack(v_local, shards[0].at(key_elements(s, own_rows)));
      const transport::RowType row_type(row_pair_bytes(s, dtype_size(s.dtype)));

      // Running state of each query segment, fp32: out [batch, rows, heads_q, dim], lse
      // [batch, heads_q, rows]; and one block's partial result.
      const std::vector<Segment>& queries = plan.segments[static_cast<std::size_t>(s.rank)];
      const std::vector<std::int64_t> query_rows = local_offsets(plan, s.rank);
      std::vector<Buffer> state_out(queries.size());
      std::vector<std::vector<float>> state_lse(queries.size());
      Buffer part_out, part_out_f32;
      std::vector<float> part_lse;
      std::int64_t max_segment = 0;
      for (std::size_t i = 0; i < queries.size(); ++i) {
        const std::int64_t rows = queries[i].length;
        max_segment = std::max(max_segment, rows);
        // Zeros: the merge weighs a side with lse −inf by 0, and 0·x of garbage could be NaN.
        state_out[i].reserve_zeroed(DType::f32, s.batch * rows * s.heads_q * s.head_dim_v);
        state_lse[i].assign(static_cast<std::size_t>(s.batch * s.heads_q * rows),
                            kNegativeInfinity);
      }
      part_out.reserve(s.dtype, s.batch * max_segment * s.heads_q * s.head_dim_v);
      part_out_f32.reserve(
          DType::f32, s.dtype == DType::f32 ? 0 : s.batch * max_segment * s.heads_q * s.head_dim_v);
      part_lse.resize(static_cast<std::size_t>(s.batch * s.heads_q * max_segment));

      Transfers transfers(comm, s.threaded, ring.timeout_seconds, caller, s.rank);
      for (int step = 0; step < s.ranks; ++step) {
        const int owner = plan.owner_at(step);
        Buffer& current = shards[step % 2];
        Buffer& incoming = shards[(step + 1) % 2];
        const bool holding = plan.held(owner, step);
        const std::int64_t rows = plan.rows[static_cast<std::size_t>(owner)];
        move_shards(transfers, s, step, current, incoming, row_type.get());
        transfers.start();

        const Clock::time_point compute_start = Clock::now();
        if (holding) {
          const ShardView shard = shard_view(s, current, rows);
          const std::vector<std::int64_t> key_rows = local_offsets(plan, owner);
          const std::vector<Segment>& keys = plan.segments[static_cast<std::size_t>(owner)];
          for_each_visible_pair(plan, owner, stats, [&](std::size_t i, std::size_t j) {
            const std::int64_t q_rows = queries[i].length;
            const std::array<std::int64_t, 4> out_shape{s.batch, q_rows, s.heads_q, s.head_dim_v};
            const TensorView partial = part_out.view(0, out_shape);
            detail::block_attention_forward(
                AttentionImpl::flash, sequence_slice(q_local, query_rows[i], q_rows),
                sequence_slice(shard.k, key_rows[j], keys[j].length),
                sequence_slice(shard.v, key_rows[j], keys[j].length), partial, part_lse.data(),
                options, queries[i].begin - keys[j].begin);
            TensorView partial_f32 = partial;
            if (s.dtype != DType::f32) {
              partial_f32 = part_out_f32.view(0, out_shape);
              detail::load_row_f32(static_cast<float*>(partial_f32.data), partial.data, s.dtype, 0,
                                   partial.numel());
            }
            const TensorView state = state_out[i].view(0, out_shape);
            merge_attention_states(state, state_lse[i].data(), partial_f32, part_lse.data(), state,
                                   state_lse[i].data(), options.num_threads);
            ++stats.blocks_computed;
            transfers.progress();
          });
        }
        stats.compute_seconds += seconds_since(compute_start);
        stats.exposed_seconds += transfers.finish();
      }

      for (std::size_t i = 0; i < queries.size(); ++i) {
        const std::int64_t rows = queries[i].length;
        if (rows == 0) continue;
        store(state_out[i].floats(), sequence_slice(out_local, query_rows[i], rows));
        if (lse_local != nullptr) {
          for (std::int64_t bh = 0; bh < s.batch * s.heads_q; ++bh) {
            std::memcpy(
                lse_local + bh * plan.rows[static_cast<std::size_t>(s.rank)] + query_rows[i],
                state_lse[i].data() + bh * rows, static_cast<std::size_t>(rows) * sizeof(float));
          }
        }
      }
      stats.transfer_seconds = transfers.transfer_seconds;
      stats.bytes_sent = transfers.bytes_sent;
      stats.seconds = seconds_since(call_start);
      return stats;
    });
  });
}

RingStats ring_attention_backward(MPI_Comm comm, const ConstTensorView& dout_local,
                                  const ConstTensorView& q_local, const ConstTensorView& k_local,
                                  const ConstTensorView& v_local, const ConstTensorView& out_local,
                                  const float* lse_local, const TensorView& dq_local,
                                  const TensorView& dk_local, const TensorView& dv_local,
                                  const AttentionOptions& options, const RingOptions& ring) {
  constexpr const char* caller = "ring_attention_backward";
  return run_collective(caller, [&] {
    const Clock::time_point call_start = Clock::now();
    const std::string local_error = error_of([&] {
      detail::make_backward_params(caller, dout_local, q_local, k_local, v_local, out_local,
                                   lse_local, dq_local, dk_local, dv_local, options);
      refuse_dropout(caller, options);
    });
    const Setup s = agree(comm, caller, q_local, k_local, v_local, options, ring, local_error);
    return after_agreement(caller, s.rank, [&] {
      const Plan& plan = s.plan;
      RingStats stats;

      const std::int64_t max_rows = *std::max_element(plan.rows.begin(), plan.rows.end());
      const std::int64_t own_rows = plan.rows[static_cast<std::size_t>(s.rank)];
      Buffer shards[2];
      for (Buffer& buffer : shards) buffer.reserve(s.dtype, shard_elements(s, max_rows));
      pack(k_local, shards[0].at(0));
      pack(v_local, shards[0].at(key_elements(s, own_rows)));
      const transport::RowType row_type(row_pair_bytes(s, dtype_size(s.dtype)));
      const transport::RowType gradient_row_type(row_pair_bytes(s, sizeof(float)));

      // dK and dV of a shard, fp32 [dK rows | dV rows]: this rank's share of the block in hand, the
      // sum of the earlier ranks' shares arriving with it, the sum being sent on, and this rank's
      // own shard's total coming home.
      Buffer share, arriving_sum, outgoing_sum, own_total;
      for (Buffer* buffer : {&share, &arriving_sum, &outgoing_sum}) {
        buffer->reserve(DType::f32, shard_elements(s, max_rows));
      }
      // Zeroed, that is touched: it is received last, with no compute left to hide the page
      // faults of fresh memory behind (0.2 s for 64 MiB here).
      own_total.reserve_zeroed(DType::f32, shard_elements(s, own_rows));

      const std::vector<Segment>& queries = plan.segments[static_cast<std::size_t>(s.rank)];
      const std::vector<std::int64_t> query_rows = local_offsets(plan, s.rank);
      std::vector<std::vector<float>> dq_sum(queries.size()), segment_lse(queries.size());
      std::int64_t max_segment = 0, max_key_segment = 0;
      for (std::size_t i = 0; i < queries.size(); ++i) {
        const std::int64_t rows = queries[i].length;
        max_segment = std::max(max_segment, rows);
        dq_sum[i].assign(static_cast<std::size_t>(s.batch * rows * s.heads_q * s.head_dim), 0.0f);
        if (rows == 0) continue;
        // The segment's lse rows, contiguous [batch, heads_q, rows] as the block backward takes it.
        segment_lse[i].resize(static_cast<std::size_t>(s.batch * s.heads_q * rows));
        for (std::int64_t bh = 0; bh < s.batch * s.heads_q; ++bh) {
          std::memcpy(segment_lse[i].data() + bh * rows, lse_local + bh * own_rows + query_rows[i],
                      static_cast<std::size_t>(rows) * sizeof(float));
        }
      }
      for (const std::vector<Segment>& segments : plan.segments) {
        for (const Segment& segment : segments)
          max_key_segment = std::max(max_key_segment, segment.length);
      }
      Buffer part_dq, part_dk, part_dv;
      part_dq.reserve(s.dtype, s.batch * max_segment * s.heads_q * s.head_dim);
      part_dk.reserve(s.dtype, key_elements(s, max_key_segment));
      part_dv.reserve(s.dtype, s.batch * max_key_segment * s.heads_kv * s.head_dim_v);

      // Where the sum over a shard goes once this rank has added its share at `step`: on around
      // the ring, home to its owner, or nowhere (it is this rank's own, complete).
      const auto send_sum = [&](Transfers& transfers, int step) {
        const int owner = plan.owner_at(step);
        if (!plan.held(owner, step)) return;
        const std::int64_t count = s.batch * plan.rows[static_cast<std::size_t>(owner)];
        if (plan.sent_on(owner, step)) {
          transfers.send(outgoing_sum.at(0), count, gradient_row_type.get(), plan.next(),
                         kTagGradients);
        } else if (owner != s.rank) {
          transfers.send(outgoing_sum.at(0), count, gradient_row_type.get(), owner,
                         kTagFinalGradients);
        } else {
          std::copy_n(outgoing_sum.floats(), shard_elements(s, own_rows), own_total.floats());
        }
      };
      const int own_last_step = plan.last_step(s.rank);
      const auto receive_own_total = [&](Transfers& transfers, int batch) {
        if (own_last_step >= 1 && batch == own_last_step + 1) {
          transfers.receive(own_total.at(0), s.batch * own_rows, gradient_row_type.get(),
                            plan.at(s.rank, own_last_step), kTagFinalGradients);
        }
      };

      Transfers transfers(comm, s.threaded, ring.timeout_seconds, caller, s.rank);
      for (int step = 0; step < s.ranks; ++step) {
        const int owner = plan.owner_at(step);
        Buffer& current = shards[step % 2];
        Buffer& incoming = shards[(step + 1) % 2];
        const bool holding = plan.held(owner, step);
        const std::int64_t rows = plan.rows[static_cast<std::size_t>(owner)];
        const std::int64_t elements = shard_elements(s, rows), keys_end = key_elements(s, rows);
        // This step's messages: K/V on to the next rank and in from the previous one; the sum the
        // previous step finished, on its way; the sum over the shard in hand, arriving.
        move_shards(transfers, s, step, current, incoming, row_type.get());
        if (step > 0) send_sum(transfers, step - 1);
        if (step > 0 && holding) {
          transfers.receive(arriving_sum.at(0), s.batch * rows, gradient_row_type.get(),
                            plan.previous(), kTagGradients);
        }
        receive_own_total(transfers, step);
        transfers.start();

        const Clock::time_point compute_start = Clock::now();
        if (holding) {
          std::fill_n(share.floats(), elements, 0.0f);
          const ShardView shard = shard_view(s, current, rows);
          const std::vector<std::int64_t> key_rows = local_offsets(plan, owner);
          const std::vector<Segment>& keys = plan.segments[static_cast<std::size_t>(owner)];
          for_each_visible_pair(plan, owner, stats, [&](std::size_t i, std::size_t j) {
            const std::int64_t q_rows = queries[i].length, k_rows = keys[j].length;
            const TensorView dq = part_dq.view(0, {s.batch, q_rows, s.heads_q, s.head_dim});
            const TensorView dk = part_dk.view(0, {s.batch, k_rows, s.heads_kv, s.head_dim});
            const TensorView dv = part_dv.view(0, {s.batch, k_rows, s.heads_kv, s.head_dim_v});
            detail::block_attention_backward(
                AttentionImpl::flash, sequence_slice(dout_local, query_rows[i], q_rows),
                sequence_slice(q_local, query_rows[i], q_rows),
                sequence_slice(shard.k, key_rows[j], k_rows),
                sequence_slice(shard.v, key_rows[j], k_rows),
                sequence_slice(out_local, query_rows[i], q_rows), segment_lse[i].data(), dq, dk, dv,
                options, queries[i].begin - keys[j].begin);
            add_to(dq_sum[i].data(), dq.data, s.dtype, dq.numel());
            // The segment's rows of dK and dV within the shard's [batch, rows, heads_kv, dims].
            const std::int64_t key_row = s.heads_kv * s.head_dim,
                               value_row = s.heads_kv * s.head_dim_v;
            for (std::int64_t b = 0; b < s.batch; ++b) {
              const std::int64_t row = b * rows + key_rows[j];
              add_to(share.floats() + row * key_row,
                     static_cast<const char*>(dk.data) + b * k_rows * key_row * dtype_size(s.dtype),
                     s.dtype, k_rows * key_row);
              add_to(
                  share.floats() + keys_end + row * value_row,
                  static_cast<const char*>(dv.data) + b * k_rows * value_row * dtype_size(s.dtype),
                  s.dtype, k_rows * value_row);
            }
            ++stats.blocks_computed;
            transfers.progress();
          });
        }
        stats.compute_seconds += seconds_since(compute_start);
        stats.exposed_seconds += transfers.finish();
        if (holding) {
          float* sum = outgoing_sum.floats();
          const float* earlier = arriving_sum.floats();
          const float* mine = share.floats();
          for (std::int64_t e = 0; e < elements; ++e) {
            sum[e] = mine[e] + (step > 0 ? earlier[e] : 0.0f);
          }
        }
      }
      send_sum(transfers, s.ranks - 1);
      receive_own_total(transfers, s.ranks);
      transfers.start();
      stats.exposed_seconds += transfers.finish();

      for (std::size_t i = 0; i < queries.size(); ++i) {
        const std::int64_t rows = queries[i].length;
        if (rows == 0) continue;
        store(dq_sum[i].data(), sequence_slice(dq_local, query_rows[i], rows));
      }
      store(own_total.floats(), dk_local);
      store(own_total.floats() + key_elements(s, own_rows), dv_local);
      stats.transfer_seconds = transfers.transfer_seconds;
      stats.bytes_sent = transfers.bytes_sent;
      stats.seconds = seconds_since(call_start);
      return stats;
    });
  });
}

}  // namespace flashattn::dist
