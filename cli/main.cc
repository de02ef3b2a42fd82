// `sdpa`: the command-line tool. Wires the subcommands together and turns every failure into
// one line on stderr, "sdpa: error: ...", with exit status 2 for a bad command line (what
// CLI11 rejects while parsing) and 1 for everything else. --help and --version exit 0.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>

#include "commands.h"

namespace {

constexpr int kFailure = 1;     // the command ran and failed
constexpr int kUsageError = 2;  // the command line is wrong (as getopt-style tools do)

// One line whatever the message holds, so scripts can rely on it.
void print_error(const std::string& message) {
  std::string line = message;
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::cerr << "sdpa: error: " << line << '\n';
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sdpa: exact scaled dot-product attention on the CPU", "sdpa"};
  app.set_version_flag("--version", SDPA_VERSION, "Print the version and exit");
  app.require_subcommand(1);
  CLI::App* demo = sdpa_cli::add_demo_command(app);
  sdpa_cli::RunOptions run_options;
  CLI::App* run = sdpa_cli::add_run_command(app, run_options);
  sdpa_cli::BenchOptions bench_options;
  CLI::App* bench = sdpa_cli::add_bench_command(app, bench_options);
  sdpa_cli::InspectOptions inspect_options;
  CLI::App* inspect = sdpa_cli::add_inspect_command(app, inspect_options);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version arrive as "errors" with exit code 0: CLI11 prints them. A real parse
    // error gets our one line instead of CLI11's two ("... Run with --help for more
    // information.") and its exit codes above 100.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::string help = "sdpa";  // "sdpa run" when the error is in run's options
    for (const CLI::App* sub : app.get_subcommands()) help += " " + sub->get_name();
    std::string message = e.what();
    if (help == "sdpa" && argc > 1 && argv[1][0] != '-') {
      // CLI11 says "A subcommand is required" for `sdpa frobnicate`: name the word instead.
      std::string commands;
      for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
        commands += (commands.empty() ? "" : ", ") + sub->get_name();
      }
      message = std::string("unknown command '") + argv[1] + "'; the commands are " + commands;
    }
    print_error(message + " (see " + help + " --help)");
    return kUsageError;
  }

  try {
    if (*demo) sdpa_cli::demo_command(std::cout);
    if (*run) sdpa_cli::run_command(run_options);
    if (*bench) sdpa_cli::bench_command(bench_options);
    if (*inspect) sdpa_cli::inspect_command(inspect_options);
    if (!std::cout.flush()) throw std::runtime_error("cannot write to standard output");  // e.g. disk full
  } catch (const std::bad_alloc&) {
    // What reads and allocates the big arrays says which and how big; this is the rest.
    print_error("out of memory");
    return kFailure;
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailure;
  }
  return 0;
}
