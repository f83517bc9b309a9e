#pragma once

// The plots of `flashattn bench`: gnuplot scripts with their data inline, and running gnuplot.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "machine.hpp"
#include "measure.hpp"

namespace flashattn::cli {

// What a plot shows: the sweep's forward or backward GFLOP/s, or the decode cases' GB/s.
enum class Pass { forward, backward, decode };

// A gnuplot script that draws GFLOP/s of one pass against seqlen: one line per (path, dtype,
// head_dim, mask) over the sweep points, one horizontal line per ceiling. The data are inline, so
// the script is the only input. The backward gets a plot of its own: its lines would cross the
// forward's and double their number.
std::string plot_script(const std::filesystem::path& png, const Machine& machine,
                        const Ceilings& ceilings, const std::vector<CaseResult>& results,
                        Pass pass);

// A gnuplot script that draws the decode cases: GB/s of K and V read against the KV cache
// length, one line per (path, dtype), one dotted line per dtype for the plain reads of the same
// K and V timed with flash's calls, each dtype in a colour of its own, and the memory copy
// ceiling.
std::string decode_plot_script(const std::filesystem::path& png, const Machine& machine,
                               const Ceilings& ceilings, const std::vector<CaseResult>& results);

// One point of a line of `flashattn serve-bench`'s plot: GB/s of K and V read at x (a KV cache
// length), the line's dash type and colour (gnuplot's line type).
struct GbpsPoint {
  std::string line;
  int dash = 1, colour = 1;
  std::int64_t x = 0;
  double gbps = 0.0;
};

// A gnuplot script that draws `points` as lines of GB/s against x (log-log), with the memory
// copy ceiling.
std::string serving_plot_script(const std::filesystem::path& png, const Machine& machine,
                                double copy_gbps, const std::vector<GbpsPoint>& points,
                                const std::string& xlabel);

// `program` in the first directory of PATH that has it executable, or nothing.
std::optional<std::filesystem::path> find_on_path(const std::string& program);

// Feeds `script` to gnuplot on its stdin, its stdout discarded; returns why it failed, or
// nothing on success.
std::optional<std::string> run_gnuplot(const std::filesystem::path& gnuplot,
                                       const std::string& script);

}  // namespace flashattn::cli
