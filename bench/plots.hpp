#pragma once

// The plots of `flashattn bench`: gnuplot scripts with their data inline, and running gnuplot.

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

// `program` in the first directory of PATH that has it executable, or nothing.
std::optional<std::filesystem::path> find_on_path(const std::string& program);

// Feeds `script` to gnuplot on its stdin, its stdout discarded; returns why it failed, or
// nothing on success.
std::optional<std::string> run_gnuplot(const std::filesystem::path& gnuplot,
                                       const std::string& script);

}  // namespace flashattn::cli
