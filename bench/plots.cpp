// gnuplot scripts of the sweep and decode results, and the gnuplot run that draws them.

#include "plots.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <utility>

#include "report.hpp"

extern char** environ;

namespace flashattn::cli {

namespace fs = std::filesystem;

namespace {

// gnuplot's single-quoted strings take everything literally except a doubled quote.
std::string gnuplot_string(const std::string& text) {
  std::string quoted = "'";
  for (const char c : text) {
    quoted += c;
    if (c == '\'') quoted += '\'';
  }
  return quoted + "'";
}

// The terminal and output lines every plot script starts with.
std::string plot_preamble(const fs::path& png) {
  return "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
         "  set terminal pngcairo size 1200,760 noenhanced font ',10'\n"
         "} else {\n"
         "  set terminal png size 1200,760 noenhanced\n"
         "}\n"
         "set output " +
         gnuplot_string(png.string()) + "\n";
}

// The plot title: what ran, where and when.
std::string plot_title(const char* what, const Machine& machine) {
  char title[512];
  std::snprintf(title, sizeof(title), "flashattn bench%s, %s, %s (%s), %d threads, %s", what,
                machine.date.c_str(), machine.cpu_model.c_str(), machine.host.c_str(),
                machine.threads, machine.simd_target.c_str());
  return "set title " + gnuplot_string(title) + "\n";
}

// The y axis, scales and key of the plots of K/V bandwidth against the cache length.
constexpr const char* kv_bandwidth_axes =
    "set ylabel 'GB/s of K and V read (log scale)'\n"
    "set logscale xy 2\n"
    "set format x '%.0f'\n"
    "set format y '%.1f'\n"
    "set grid\n"
    "set key outside right top\n";

// A line of a plot: its title, dash type, colour (gnuplot's line type; 0: the next one in
// turn) and points (x, y), the data inline as $series<index>.
struct PlotLine {
  std::string title;
  int dash = 1;
  int colour = 0;
  std::vector<std::pair<std::int64_t, double>> points;
};

// The data blocks of `lines` (appended to `script`) and the plot command's clauses for them.
std::string plot_lines(const std::map<std::string, PlotLine>& lines, std::string& script) {
  int index = 0;
  std::string plots;
  for (const auto& [name, line] : lines) {
    std::string block = "$series" + std::to_string(index) + " << EOD\n";
    std::vector<std::pair<std::int64_t, double>> points = line.points;
    std::sort(points.begin(), points.end());
    for (const auto& [x, y] : points) block += std::to_string(x) + " " + format("%.3f", y) + "\n";
    script += block + "EOD\n";
    plots += (plots.empty() ? "" : ", ") + std::string("$series") + std::to_string(index) +
             " using 1:2 with linespoints lw 2 pt 7 dt " + std::to_string(line.dash) +
             (line.colour > 0 ? " lc " + std::to_string(line.colour) : "") + " title " +
             gnuplot_string(line.title);
    ++index;
  }
  return plots;
}

// A horizontal line at `value`, titled with it, for the plot command; `colour` a gnuplot colour
// spec, or empty for the next line type's.
std::string plot_ceiling(double value, const std::string& name, const std::string& colour = "") {
  return ", " + format("%.3f", value) + " with lines lw 2 dt 3" +
         (colour.empty() ? "" : " lc " + colour) + " title " +
         gnuplot_string(name + format(" %.0f", value));
}

}  // namespace

std::string plot_script(const fs::path& png, const Machine& machine, const Ceilings& ceilings,
                        const std::vector<CaseResult>& results, Pass pass) {
  std::map<std::string, PlotLine> lines;
  std::set<DType> dtypes;
  std::set<std::int64_t> head_dims;
  for (const CaseResult& result : results) {
    if (result.shape.seed_shape || result.shape.decode) continue;
    for (const PathResult& path : result.paths) {
      const std::optional<double> gflops =
          pass == Pass::forward ? result.gflops(path.impl) : result.backward_gflops(path.impl);
      if (!gflops) continue;
      const Case& shape = result.shape;
      char title[96];
      std::snprintf(title, sizeof(title), "%s %s D=%lld%s", impl_name(path.impl),
                    dtype_name(shape.dtype), static_cast<long long>(shape.head_dim),
                    shape.causal ? "" : " non-causal");
      PlotLine& line = lines[title];
      line.title = title;
      line.dash = path.impl == AttentionImpl::flash ? 1 : 2;
      line.points.emplace_back(shape.seqlen, *gflops);
      dtypes.insert(shape.dtype);
      head_dims.insert(shape.head_dim);
    }
  }

  std::string script =
      plot_preamble(png) + plot_title(pass == Pass::forward ? "" : " backward", machine) +
      "set xlabel 'sequence length (causal unless marked; FLOPs count unmasked "
      "pairs)'\n" +
      std::string(pass == Pass::forward ? "set ylabel 'GFLOP/s (log scale)'\n"
                                        : "set ylabel 'backward GFLOP/s, 2.5x the forward FLOPs "
                                          "(log scale)'\n") +
      "set logscale xy 2\n"
      "set format x '%.0f'\n"
      "set format y '%.0f'\n"
      "set grid\n"
      "set key outside right top\n";
  std::string plots = plot_lines(lines, script);
  plots += plot_ceiling(ceilings.fma_gflops, "f32 FMA peak");
  if (ceilings.bf16_dot_gflops && dtypes.count(DType::bf16) > 0) {
    plots += plot_ceiling(*ceilings.bf16_dot_gflops, "bf16 dot peak");
  }
  if (ceilings.amx_gflops && dtypes.count(DType::bf16) > 0) {
    plots += plot_ceiling(*ceilings.amx_gflops, "AMX bf16 peak");
  }
  for (const std::int64_t head_dim : head_dims) {
    plots += plot_ceiling(ceilings.sgemm_gflops.at(head_dim),
                          "sgemm " + std::to_string(head_dim) + "-dim attention products");
  }
  return script + "plot " + plots + "\n";
}

std::string decode_plot_script(const fs::path& png, const Machine& machine,
                               const Ceilings& ceilings, const std::vector<CaseResult>& results) {
  std::map<std::string, PlotLine> lines;
  for (const CaseResult& result : results) {
    if (!result.shape.decode) continue;
    const Case& shape = result.shape;
    const int colour = 1 + static_cast<int>(shape.dtype);
    for (const PathResult& path : result.paths) {
      const std::optional<double> gbps = result.kv_gbps(path.impl);
      if (!gbps) continue;
      const std::string title = std::string(impl_name(path.impl)) + " " + dtype_name(shape.dtype);
      PlotLine& line = lines[title];
      line.title = title;
      line.dash = path.impl == AttentionImpl::flash ? 1 : 2;
      line.colour = colour;
      line.points.emplace_back(shape.seqlen, *gbps);
    }
    if (const std::optional<double> read = result.read_gbps(AttentionImpl::flash)) {
      const std::string title = std::string("read of K and V, ") + dtype_name(shape.dtype);
      PlotLine& line = lines[title];
      line.title = title;
      line.dash = 3;
      line.colour = colour;
      line.points.emplace_back(shape.seqlen, *read);
    }
  }
  char xlabel[160];
  std::snprintf(xlabel, sizeof(xlabel),
                "set xlabel 'KV cache length Skv (one query position, Hq = %lld, Hkv = %lld, D "
                "= %lld)'\n",
                static_cast<long long>(kDecodeHeadsQ), static_cast<long long>(kDecodeHeadsKv),
                static_cast<long long>(kDecodeHeadDim));
  std::string script =
      plot_preamble(png) + plot_title(" decode", machine) + xlabel + kv_bandwidth_axes;
  std::string plots = plot_lines(lines, script);
  plots += plot_ceiling(ceilings.copy_gbps, "memory copy (read + written)", "rgb 'black'");
  return script + "plot " + plots + "\n";
}

std::string serving_plot_script(const fs::path& png, const Machine& machine, double copy_gbps,
                                const std::vector<GbpsPoint>& points, const std::string& xlabel) {
  std::map<std::string, PlotLine> lines;
  for (const GbpsPoint& point : points) {
    PlotLine& line = lines[point.line];
    line.title = point.line;
    line.dash = point.dash;
    line.colour = point.colour;
    line.points.emplace_back(point.x, point.gbps);
  }
  char title[512];
  std::snprintf(title, sizeof(title), "flashattn serve-bench, %s, %s (%s), %d threads, %s",
                machine.date.c_str(), machine.cpu_model.c_str(), machine.host.c_str(),
                machine.threads, machine.simd_target.c_str());
  std::string script = plot_preamble(png) + "set title " + gnuplot_string(title) + "\n" +
                       "set xlabel " + gnuplot_string(xlabel) + "\n" + kv_bandwidth_axes;
  std::string plots = plot_lines(lines, script);
  plots += plot_ceiling(copy_gbps, "memory copy (read + written)", "rgb 'black'");
  return script + "plot " + plots + "\n";
}

std::optional<fs::path> find_on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return std::nullopt;
  const std::string directories = path;
  std::size_t start = 0;
  while (start <= directories.size()) {
    const std::size_t end = std::min(directories.find(':', start), directories.size());
    const fs::path candidate =
        fs::path(end > start ? directories.substr(start, end - start) : ".") / program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return std::nullopt;
}

std::optional<std::string> run_gnuplot(const fs::path& gnuplot, const std::string& script) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return "cannot create a pipe to gnuplot";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[0], 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  std::string program = gnuplot.string();
  char* argv[] = {program.data(), nullptr};
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipe_fds[0]);
  if (spawned != 0) {
    ::close(pipe_fds[1]);
    return "cannot start " + program;
  }
  const char* bytes = script.data();
  std::size_t left = script.size();
  while (left > 0) {
    const ssize_t written = ::write(pipe_fds[1], bytes, left);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) break;
    bytes += written;
    left -= static_cast<std::size_t>(written);
  }
  ::close(pipe_fds[1]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (left > 0) return "gnuplot stopped reading its script";
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "gnuplot failed (see its messages)";
  return std::nullopt;
}

}  // namespace flashattn::cli
