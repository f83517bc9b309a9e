// The `flashattn` command-line tool: wires the subcommands together and turns every error into
// one line on stderr and a non-zero exit.

#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <string>

#include "cli_common.hpp"
#include "flashattn/introspect.hpp"

namespace {

// The contract is one line per error: fold any line breaks in a message.
std::string one_line(std::string message) {
  for (char& c : message) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return message;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashattn::cli;
  CLI::App app{"Exact multi-head attention, computed the standard way and the FlashAttention way.",
               "flashattn"};
  app.set_version_flag("--version", [] {
    return std::string("flashattn ") + flashattn::version() + "\nSIMD target " +
           flashattn::simd_target() + "\nBLAS " + flashattn::blas();
  });
  // At most one here; "none" is reported after parsing, so that a mistyped subcommand is named
  // in the error instead of being hidden behind "a subcommand is required".
  app.require_subcommand(0, 1);
  const Action demo = add_demo_command(app);
  const Action run = add_run_command(app);
  const Action bench = add_bench_command(app);
  const Action serve_bench = add_serve_bench_command(app);
  const Action modifier_bench = add_modifier_bench_command(app);
#ifdef FLASHATTN_WITH_MPI
  const Action ring = add_ring_command(app);
#endif

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);  // --help, --version
    std::cerr << "flashattn: error: " << one_line(error.what()) << " (see --help)\n";
    return kExitUsage;
  }

  if (app.get_subcommands().empty()) {
    std::cerr << "flashattn: error: expected a subcommand, demo, run, bench, serve-bench, "
                 "modifier-bench"
#ifdef FLASHATTN_WITH_MPI
                 " or ring"
#endif
                 " (see --help)\n";
    return kExitUsage;
  }
  try {
    if (app.got_subcommand("demo")) return demo();
    if (app.got_subcommand("serve-bench")) return serve_bench();
    if (app.got_subcommand("modifier-bench")) return modifier_bench();
#ifdef FLASHATTN_WITH_MPI
    if (app.got_subcommand("ring")) return ring();
#endif
    return app.got_subcommand("bench") ? bench() : run();
  } catch (const std::exception& error) {
    std::cerr << "flashattn: error: " << one_line(error.what()) << '\n';
    return kExitError;
  }
}
