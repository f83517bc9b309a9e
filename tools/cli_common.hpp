#pragma once

// Pieces shared by the `flashattn` subcommands.

#include <CLI/CLI.hpp>
#include <array>
#include <charconv>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "timing.hpp"

namespace flashattn::cli {

// Exit codes of the tool.
constexpr int kExitOk = 0;
constexpr int kExitError = 1;     // invalid input, unreadable or unwritable file
constexpr int kExitUsage = 2;     // bad command line
constexpr int kExitMismatch = 3;  // `demo`: the two paths disagree; `bench`: a path failed
                                  // verification

// Each subcommand adds itself to `app` and returns the action to run once `app` has parsed the
// command line and chosen that subcommand.
using Action = std::function<int()>;
Action add_demo_command(CLI::App& app);
Action add_run_command(CLI::App& app);
Action add_bench_command(CLI::App& app);
Action add_serve_bench_command(CLI::App& app);
Action add_modifier_bench_command(CLI::App& app);
#ifdef FLASHATTN_WITH_MPI
Action add_ring_command(CLI::App& app);  // built with FLASHATTN_MPI
#endif

// The worker threads a call with `requested` threads uses (0 = all that OpenMP offers).
int resolved_threads(int requested);

// `--threads` of a subcommand: 0 (all) to flashattn::kMaxThreads, checked when the command line is
// parsed, before the subcommand allocates or starts anything.
CLI::Option* add_threads_option(CLI::App* command, int* threads);

// The whole of `text` as a number of that type; false when anything else is there.
template <class Number>
bool parse_number(std::string_view text, Number& value) {
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  return error == std::errc() && stop == end;
}

// "L,R" with integers >= -1, -1 meaning unbounded on that side.
std::optional<std::array<std::int64_t, 2>> parse_window(const std::string& text);

// `--window L,R` of a subcommand (default "-1,-1": no window), checked when parsed.
CLI::Option* add_window_option(CLI::App* command, std::string* window);

// "C": a finite number >= 0, the score soft cap (0 = off).
std::optional<float> parse_softcap(const std::string& text);

// `--softcap C` of a subcommand (default "0": off), checked when parsed.
CLI::Option* add_softcap_option(CLI::App* command, std::string* softcap);

// The ALiBi paper's slopes for `heads` heads (Press et al. 2022): the geometric sequence
// 2^(-8/n), 2^(-16/n), ... for the largest power of two n <= heads, then for the heads beyond n
// every other slope of the sequence for 2n.
std::vector<float> alibi_paper_slopes(std::int64_t heads);

}  // namespace flashattn::cli
