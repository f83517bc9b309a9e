// `flashattn ring`: ring attention across the ranks of mpirun (flashattn/dist.hpp). Rank 0 reads
// the inputs (or draws random ones), deals each rank its shard, every rank runs the ring, and
// rank 0 gathers the outputs, writes them (whole or not at all) and prints one JSON line.
//
// Errors: whatever rank 0 finds wrong before the ring (a file, a shape) and whatever the ring's
// validation finds wrong on any rank reaches every rank alike; rank 0 prints it once and every
// rank exits 1. A rank that cannot go on once the ring runs (dist::RingAborted: a peer silent
// past --timeout, out of memory) prints its own error and aborts the job.

#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli_common.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/dist.hpp"
#include "flashattn/error.hpp"
#include "npy.hpp"

namespace flashattn::cli {
namespace {

struct RingCommandOptions {
  std::string q_path, k_path, v_path, out_path;
  std::string dout_path, dq_path, dk_path, dv_path;
  std::string shape;  // "B,S,Hq,Hkv,D": random inputs instead of files
  std::string dtype = "f32";
  std::uint64_t seed = 0;
  bool causal = false;
  std::string window = "-1,-1";
  std::string sharding = "zigzag";
  int threads = 0;
  double timeout = 300.0;
  bool check = false;
};

std::optional<std::array<std::int64_t, 5>> parse_shape(const std::string& text) {
  std::array<std::int64_t, 5> dims{};
  std::size_t begin = 0;
  for (int d = 0; d < 5; ++d) {
    const std::size_t end = d < 4 ? text.find(',', begin) : text.size();
    if (end == std::string::npos) return std::nullopt;
    if (!parse_number(std::string_view(text).substr(begin, end - begin), dims[d]) || dims[d] < 1) {
      return std::nullopt;
    }
    begin = end + 1;
  }
  if (dims[2] % dims[3] != 0) return std::nullopt;
  return dims;
}

std::optional<DType> parse_dtype(const std::string& text) {
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    if (text == dtype_name(dtype)) return dtype;
  }
  return std::nullopt;
}

std::optional<dist::Sharding> parse_sharding(const std::string& text) {
  for (dist::Sharding sharding : {dist::Sharding::contiguous, dist::Sharding::zigzag}) {
    if (text == dist::sharding_name(sharding)) return sharding;
  }
  return std::nullopt;
}

// An Error that every rank raises alike: rank 0 reports it, every rank exits 1.
class AgreedError : public Error {
 public:
  using Error::Error;
};

// MPI for the command's lifetime; finalized on the way out unless the job was aborted.
class MpiSession {
 public:
  MpiSession() {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  }
  ~MpiSession() { MPI_Finalize(); }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  // Raises `rank0_error` (rank 0's; empty: none) as an AgreedError on every rank.
  void agree(const std::string& rank0_error) const {
    int failed = rank0_error.empty() ? 0 : 1;
    MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (!failed) return;
    std::vector<char> message(4096, '\0');
    if (rank == 0) std::strncpy(message.data(), rank0_error.c_str(), message.size() - 1);
    MPI_Bcast(message.data(), static_cast<int>(message.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
    throw AgreedError(message.data());
  }

  int rank = 0, ranks = 1;
};

// A whole tensor on rank 0, or a rank's shard: contiguous [batch, rows, heads, dim] of dtype.
struct Tensor {
  DType dtype = DType::f32;
  std::array<std::int64_t, 4> shape{};
  std::vector<std::byte> bytes;

  Tensor() = default;
  Tensor(DType type, std::array<std::int64_t, 4> dims) : dtype(type), shape(dims) {
    bytes.resize(static_cast<std::size_t>(numel()) * dtype_size(dtype));
  }
  std::int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  TensorView view() { return contiguous_view(bytes.data(), dtype, shape); }
  ConstTensorView view() const { return contiguous_view(bytes.data(), dtype, shape); }
  std::vector<float> to_f32() const {
    std::vector<float> values(static_cast<std::size_t>(numel()));
    for (std::int64_t i = 0; i < numel(); ++i) values[i] = load_f32(bytes.data(), dtype, i);
    return values;
  }
};

// What rank 0 tells every rank about the problem before dealing the shards.
struct Header {
  std::int64_t batch = 0, seqlen = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  std::int32_t dtype = 0, backward = 0;
};

Tensor read_tensor(const char* name, const std::string& path) {
  npy::Array array;
  try {
    array = npy::read_npy(path);
  } catch (const Error& error) {
    throw Error(std::string(name) + ": " + error.what());
  }
  if (array.shape.size() != 4) {
    throw Error(std::string(name) +
                ": expected a rank-4 array [batch, seqlen, heads, head_dim], got " +
                std::to_string(array.shape.size()) + " dims in " + path);
  }
  Tensor tensor(array.dtype, {array.shape[0], array.shape[1], array.shape[2], array.shape[3]});
  std::memcpy(tensor.bytes.data(), array.data(), tensor.bytes.size());
  return tensor;
}

Tensor random_tensor(DType dtype, std::array<std::int64_t, 4> shape, std::mt19937_64& rng) {
  Tensor tensor(dtype, shape);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t i = 0; i < tensor.numel(); ++i) {
    store_f32(tensor.bytes.data(), dtype, i, normal(rng));
  }
  return tensor;
}

// Rank 0's inputs: read and checked, or drawn.
struct Inputs {
  Tensor q, k, v, dout;
};

Inputs load_inputs(const RingCommandOptions& o) {
  Inputs in;
  if (!o.shape.empty()) {
    const std::array<std::int64_t, 5> s = *parse_shape(o.shape);
    const DType dtype = *parse_dtype(o.dtype);
    std::mt19937_64 rng(o.seed);
    in.q = random_tensor(dtype, {s[0], s[1], s[2], s[4]}, rng);
    in.k = random_tensor(dtype, {s[0], s[1], s[3], s[4]}, rng);
    in.v = random_tensor(dtype, {s[0], s[1], s[3], s[4]}, rng);
    if (!o.dq_path.empty()) {
      in.dout = random_tensor(dtype, in.q.shape, rng);
    }
    return in;
  }
  in.q = read_tensor("--q", o.q_path);
  in.k = read_tensor("--k", o.k_path);
  in.v = read_tensor("--v", o.v_path);
  if (!o.dout_path.empty()) in.dout = read_tensor("--dout", o.dout_path);
  const auto same = [](const char* name, const Tensor& t, const Tensor& like, const char* like_name,
                       bool heads) {
    if (t.dtype != like.dtype) {
      throw Error(std::string(name) + ": expected dtype " + dtype_name(like.dtype) + " (as " +
                  like_name + "), got " + dtype_name(t.dtype));
    }
    if (t.shape[0] != like.shape[0] || t.shape[1] != like.shape[1] ||
        (heads && t.shape[2] != like.shape[2]) || t.shape[3] != like.shape[3]) {
      throw Error(std::string(name) + ": expected [" + std::to_string(like.shape[0]) + ", " +
                  std::to_string(like.shape[1]) + ", " +
                  (heads ? std::to_string(like.shape[2]) : std::string("heads_kv")) + ", " +
                  std::to_string(like.shape[3]) + "] (as " + like_name + "), got [" +
                  std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ", " +
                  std::to_string(t.shape[2]) + ", " + std::to_string(t.shape[3]) + "]");
    }
  };
  same("--k", in.k, in.q, "--q: ring attention takes seqlen_kv = seqlen_q", false);
  same("--v", in.v, in.k, "--k", true);
  if (!o.dout_path.empty()) same("--dout", in.dout, in.q, "--q", true);
  return in;
}

// Rank 0 deals each rank its shard of `whole` (empty elsewhere); every rank returns its own.
Tensor scatter(const MpiSession& mpi, const Tensor& whole, const Header& h, std::int64_t heads,
               dist::Sharding sharding, double timeout) {
  Tensor mine(
      static_cast<DType>(h.dtype),
      {h.batch, dist::shard_length(sharding, h.seqlen, mpi.ranks, mpi.rank), heads, h.head_dim});
  dist::scatter_shards(MPI_COMM_WORLD, 0, whole.view(), sharding, mine.view(), timeout);
  return mine;
}

// Every rank's shard gathered into the whole tensor on rank 0 (empty elsewhere).
Tensor gather(const MpiSession& mpi, const Tensor& mine, const Header& h, dist::Sharding sharding,
              double timeout) {
  Tensor whole =
      mpi.rank == 0 ? Tensor(mine.dtype, {h.batch, h.seqlen, mine.shape[2], h.head_dim}) : Tensor();
  dist::gather_shards(MPI_COMM_WORLD, 0, mine.view(), sharding, whole.view(), timeout);
  return whole;
}

double max_abs_difference(const Tensor& a, const Tensor& b) {
  double worst = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = load_f32(a.bytes.data(), a.dtype, i), y = load_f32(b.bytes.data(), b.dtype, i);
    worst = std::max(worst, std::isnan(x - y) ? INFINITY : std::abs(x - y));
  }
  return worst;
}

void write_f32(npy::Writer& writer, const Tensor& t) {
  const std::vector<float> values = t.to_f32();
  writer.write(values.data(), std::vector<std::int64_t>(t.shape.begin(), t.shape.end()));
}

std::string json_list(const std::vector<double>& values, const char* format) {
  std::string text = "[";
  char number[64];
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::snprintf(number, sizeof number, format, values[i]);
    text += (i > 0 ? ", " : "") + std::string(number);
  }
  return text + "]";
}

std::vector<double> gathered(const MpiSession& mpi, double value) {
  std::vector<double> all(static_cast<std::size_t>(mpi.ranks));
  MPI_Gather(&value, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return all;
}

int run_ring(const RingCommandOptions& o, const MpiSession& mpi) {
  const bool backward = !o.dq_path.empty();
  const dist::Sharding sharding = *parse_sharding(o.sharding);
  const std::array<std::int64_t, 2> window = *parse_window(o.window);

  // Rank 0 opens the outputs first (an unwritable destination fails before any work) and loads
  // the inputs; what it finds wrong, every rank raises.
  std::unique_ptr<npy::Writer> out_writer, dq_writer, dk_writer, dv_writer;
  Inputs in;
  Header h;
  std::string problem;
  if (mpi.rank == 0) {
    try {
      if (!o.out_path.empty()) out_writer = std::make_unique<npy::Writer>(o.out_path);
      if (backward) {
        dq_writer = std::make_unique<npy::Writer>(o.dq_path);
        dk_writer = std::make_unique<npy::Writer>(o.dk_path);
        dv_writer = std::make_unique<npy::Writer>(o.dv_path);
      }
      in = load_inputs(o);
      h = {in.q.shape[0],   in.q.shape[1], in.q.shape[2],
           in.k.shape[2],   in.q.shape[3], static_cast<std::int32_t>(in.q.dtype),
           backward ? 1 : 0};
    } catch (const std::exception& error) {
      problem = error.what();
    }
  }
  mpi.agree(problem);
  MPI_Bcast(&h, sizeof h, MPI_BYTE, 0, MPI_COMM_WORLD);

  const Tensor q = scatter(mpi, in.q, h, h.heads_q, sharding, o.timeout);
  const Tensor k = scatter(mpi, in.k, h, h.heads_kv, sharding, o.timeout);
  const Tensor v = scatter(mpi, in.v, h, h.heads_kv, sharding, o.timeout);
  const Tensor dout =
      backward ? scatter(mpi, in.dout, h, h.heads_q, sharding, o.timeout) : Tensor();
  const double shift = dist::ring_shift_seconds(MPI_COMM_WORLD, k.view(), v.view());

  AttentionOptions options;
  options.causal = o.causal;
  options.window_left = window[0];
  options.window_right = window[1];
  options.num_threads = o.threads;
  const dist::RingOptions ring{.sharding = sharding, .timeout_seconds = o.timeout};
  Tensor out(q.dtype, q.shape);
  std::vector<float> lse(static_cast<std::size_t>(h.batch * h.heads_q * q.shape[1]));
  MPI_Barrier(MPI_COMM_WORLD);
  dist::RingStats stats;
  try {
    stats = dist::ring_attention_forward(MPI_COMM_WORLD, q.view(), k.view(), v.view(), out.view(),
                                         lse.data(), options, ring);
  } catch (const dist::RingAborted&) {
    throw;
  } catch (const Error& error) {
    throw AgreedError(error.what());
  }
  Tensor dq, dk, dv;
  dist::RingStats backward_stats;
  if (backward) {
    dq = Tensor(q.dtype, q.shape);
    dk = Tensor(k.dtype, k.shape);
    dv = Tensor(v.dtype, v.shape);
    MPI_Barrier(MPI_COMM_WORLD);
    try {
      backward_stats = dist::ring_attention_backward(
          MPI_COMM_WORLD, dout.view(), q.view(), k.view(), v.view(), out.view(), lse.data(),
          dq.view(), dk.view(), dv.view(), options, ring);
    } catch (const dist::RingAborted&) {
      throw;
    } catch (const Error& error) {
      throw AgreedError(error.what());
    }
  }

  // The transfers that compute could hide: the standalone shift time for each shard this rank
  // sent; exposed: what its compute thread waited for them.
  const std::int64_t shard_bytes = static_cast<std::int64_t>(k.bytes.size() + v.bytes.size());
  const double shifts = shard_bytes > 0 ? static_cast<double>(stats.bytes_sent) / shard_bytes : 0.0;
  const std::vector<double> seconds = gathered(mpi, stats.seconds);
  const std::vector<double> compute = gathered(mpi, stats.compute_seconds);
  const std::vector<double> exposed = gathered(mpi, stats.exposed_seconds);
  const std::vector<double> alone = gathered(mpi, shift * shifts);
  const std::vector<double> sent = gathered(mpi, static_cast<double>(stats.bytes_sent));
  const std::vector<double> blocks = gathered(mpi, stats.blocks_computed);
  const std::vector<double> backward_seconds = gathered(mpi, backward_stats.seconds);
  const std::vector<double> backward_compute = gathered(mpi, backward_stats.compute_seconds);
  const std::vector<double> backward_exposed = gathered(mpi, backward_stats.exposed_seconds);

  const Tensor whole_out = gather(mpi, out, h, sharding, o.timeout);
  Tensor whole_dq, whole_dk, whole_dv;
  if (backward) {
    whole_dq = gather(mpi, dq, h, sharding, o.timeout);
    whole_dk = gather(mpi, dk, h, sharding, o.timeout);
    whole_dv = gather(mpi, dv, h, sharding, o.timeout);
  }
  if (mpi.rank != 0) return kExitOk;

  std::string check;
  if (o.check) {
    // The single-process flash path on the whole problem, with all of this rank's threads.
    AttentionOptions single = options;
    single.num_threads = 0;
    Tensor want(in.q.dtype, in.q.shape);
    std::vector<float> want_lse(static_cast<std::size_t>(h.batch * h.heads_q * h.seqlen));
    flash_attention_forward(in.q.view(), in.k.view(), in.v.view(), want.view(), want_lse.data(),
                            single);
    double error = max_abs_difference(whole_out, want);
    if (backward) {
      Tensor want_dq(in.q.dtype, in.q.shape), want_dk(in.k.dtype, in.k.shape),
          want_dv(in.v.dtype, in.v.shape);
      flash_attention_backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), want.view(),
                               want_lse.data(), want_dq.view(), want_dk.view(), want_dv.view(),
                               single);
      error =
          std::max({error, max_abs_difference(whole_dq, want_dq),
                    max_abs_difference(whole_dk, want_dk), max_abs_difference(whole_dv, want_dv)});
    }
    char text[96];
    std::snprintf(text, sizeof text, ", \"max_error_vs_single_process\": %.3g", error);
    check = text;
  }
  if (out_writer) write_f32(*out_writer, whole_out);
  if (backward) {
    write_f32(*dq_writer, whole_dq);
    write_f32(*dk_writer, whole_dk);
    write_f32(*dv_writer, whole_dv);
  }

  const double exposed_sum = std::accumulate(exposed.begin(), exposed.end(), 0.0);
  const double alone_sum = std::accumulate(alone.begin(), alone.end(), 0.0);
  const double hidden = alone_sum > 0.0 ? std::clamp(1.0 - exposed_sum / alone_sum, 0.0, 1.0) : 1.0;
  const double mean_compute =
      std::accumulate(compute.begin(), compute.end(), 0.0) / static_cast<double>(mpi.ranks);
  const double balance =
      mean_compute > 0.0 ? *std::max_element(compute.begin(), compute.end()) / mean_compute : 1.0;
  const double flops = attention_flops(h.batch, h.heads_q, h.seqlen, h.seqlen, h.head_dim, options);
  const double wall = *std::max_element(seconds.begin(), seconds.end());
  std::printf(
      "{\"ranks\": %d, \"sharding\": \"%s\", \"shape\": [%lld, %lld, %lld, %lld, %lld], "
      "\"dtype\": \"%s\", \"causal\": %s, \"threads_per_rank\": %d, \"seconds\": %.6f, "
      "\"gflops\": %.2f, \"compute_seconds\": %s, \"compute_balance\": %.3f, "
      "\"bytes_sent\": %s, \"blocks_computed\": %s, \"transfer_seconds_alone\": %s, "
      "\"exposed_seconds\": %s, \"hidden_fraction\": %.3f%s%s}\n",
      mpi.ranks, dist::sharding_name(sharding), static_cast<long long>(h.batch),
      static_cast<long long>(h.seqlen), static_cast<long long>(h.heads_q),
      static_cast<long long>(h.heads_kv), static_cast<long long>(h.head_dim),
      dtype_name(static_cast<DType>(h.dtype)), o.causal ? "true" : "false",
      resolved_threads(o.threads), wall, flops / wall * 1e-9, json_list(compute, "%.4f").c_str(),
      balance, json_list(sent, "%.0f").c_str(), json_list(blocks, "%.0f").c_str(),
      json_list(alone, "%.5f").c_str(), json_list(exposed, "%.5f").c_str(), hidden,
      backward ? (", \"backward_seconds\": " + json_list(backward_seconds, "%.4f") +
                  ", \"backward_compute_seconds\": " + json_list(backward_compute, "%.4f") +
                  ", \"backward_exposed_seconds\": " + json_list(backward_exposed, "%.5f"))
                     .c_str()
               : "",
      check.c_str());
  return kExitOk;
}

}  // namespace

Action add_ring_command(CLI::App& app) {
  auto options = std::make_shared<RingCommandOptions>();
  CLI::App* command = app.add_subcommand(
      "ring", "Ring attention across MPI ranks (run under mpirun); prints one JSON line");
  command->footer(
      "Run as: mpirun -np P flashattn ring --q Q.npy --k K.npy --v V.npy --out O.npy. Rank 0 "
      "reads the inputs (q [batch, seqlen, heads_q, head_dim], k and v [batch, seqlen, heads_kv, "
      "head_dim], all float32 or all float16), deals each rank its shard of the rows, gathers "
      "the output and writes it (float32). --shape B,S,Hq,Hkv,D draws random inputs instead "
      "(--dtype, --seed). With --dout (or --shape) and --dq --dk --dv the backward runs too. "
      "--check compares with a single-process run on rank 0. The JSON line gives per rank the "
      "compute seconds, bytes sent, the standalone transfer time of what it sent, and the time "
      "its compute waited on transfers (exposed); hidden_fraction = 1 - exposed / standalone, "
      "summed over ranks. docs/dist.md explains the sharding and the figures. Nothing is "
      "written unless every rank succeeds."
      "\nExit codes: 0 success, 1 invalid input, file error or a failed rank, 2 bad command "
      "line.");
  command->add_option("--q", options->q_path, "Queries .npy");
  command->add_option("--k", options->k_path, "Keys .npy");
  command->add_option("--v", options->v_path, "Values .npy");
  command->add_option("--out", options->out_path, "Output .npy (float32)");
  command->add_option("--dout", options->dout_path, "Gradient of the output .npy, shaped as q");
  command->add_option("--dq", options->dq_path, "Gradient of q output .npy (float32)");
  command->add_option("--dk", options->dk_path, "Gradient of k output .npy (float32)");
  command->add_option("--dv", options->dv_path, "Gradient of v output .npy (float32)");
  command->add_option("--shape", options->shape, "Random inputs B,S,Hq,Hkv,D instead of files")
      ->check([](const std::string& text) -> std::string {
        return parse_shape(text) ? ""
                                 : "expected B,S,Hq,Hkv,D with integers >= 1 and Hkv dividing Hq, "
                                   "got '" +
                                       text + "'";
      });
  command->add_option("--dtype", options->dtype, "Random inputs' dtype: f32, f16 or bf16")
      ->capture_default_str()
      ->check([](const std::string& text) -> std::string {
        return parse_dtype(text) ? "" : "expected f32, f16 or bf16, got '" + text + "'";
      });
  command->add_option("--seed", options->seed, "Random inputs' seed")->capture_default_str();
  command->add_flag("--causal", options->causal, "Causal mask");
  add_window_option(command, &options->window)->capture_default_str();
  command
      ->add_option("--sharding", options->sharding,
                   "zigzag (balanced under a causal mask) or contiguous")
      ->capture_default_str()
      ->check([](const std::string& text) -> std::string {
        return parse_sharding(text) ? "" : "expected zigzag or contiguous, got '" + text + "'";
      });
  add_threads_option(command, &options->threads)->capture_default_str();
  command
      ->add_option("--timeout", options->timeout,
                   "Seconds a rank waits for a peer's message before it gives up")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_flag("--check", options->check,
                    "Compare with a single-process run on rank 0 (max_error_vs_single_process)");
  command->callback([options] {
    const bool files =
        !options->q_path.empty() || !options->k_path.empty() || !options->v_path.empty();
    if (files == !options->shape.empty()) {
      throw CLI::ValidationError("expected either --q, --k and --v (files) or --shape (random)");
    }
    if (files && (options->q_path.empty() || options->k_path.empty() || options->v_path.empty() ||
                  options->out_path.empty())) {
      throw CLI::ValidationError("--q, --k, --v and --out go together");
    }
    const bool grads =
        !options->dq_path.empty() || !options->dk_path.empty() || !options->dv_path.empty();
    if (grads &&
        (options->dq_path.empty() || options->dk_path.empty() || options->dv_path.empty())) {
      throw CLI::ValidationError("--dq, --dk and --dv go together");
    }
    if (files && grads != !options->dout_path.empty()) {
      throw CLI::ValidationError("with files, --dout and --dq --dk --dv go together");
    }
    if (!files && !options->dout_path.empty()) {
      throw CLI::ValidationError("--dout: with --shape the gradient of the output is random too");
    }
  });
  return [options] {
    MpiSession mpi;
    // Default threads: the cores shared among the ranks on this host.
    RingCommandOptions run = *options;
    if (run.threads == 0) {
      MPI_Comm local;
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
      int local_ranks = 1;
      MPI_Comm_size(local, &local_ranks);
      MPI_Comm_free(&local);
      run.threads = std::max(1, omp_get_num_procs() / local_ranks);
    }
    try {
      return run_ring(run, mpi);
    } catch (const AgreedError& error) {
      if (mpi.rank == 0) std::fprintf(stderr, "flashattn: error: %s\n", error.what());
      return kExitError;
    } catch (const std::exception& error) {
      std::fprintf(stderr, "flashattn: error: rank %d: %s\n", mpi.rank, error.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, kExitError);
      return kExitError;
    }
  };
}

}  // namespace flashattn::cli
