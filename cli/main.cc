// `sdpa`: the command-line tool. Wires the subcommands together and turns every failure into
// one line on stderr and exit status 1 (CLI11's own parse errors keep CLI11's reporting).
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"sdpa: exact scaled dot-product attention on the CPU", "sdpa"};
  app.set_version_flag("--version", SDPA_VERSION, "Print the version and exit");
  app.require_subcommand(1);
  CLI::App* demo = sdpa_cli::add_demo_command(app);
  sdpa_cli::RunOptions run_options;
  CLI::App* run = sdpa_cli::add_run_command(app, run_options);
  sdpa_cli::BenchOptions bench_options;
  CLI::App* bench = sdpa_cli::add_bench_command(app, bench_options);
  // Later: inspect, declared in commands.h like the ones above.

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);  // prints help or the parse error, and picks CLI11's exit code
  }

  try {
    if (*demo) sdpa_cli::demo_command(std::cout);
    if (*run) sdpa_cli::run_command(run_options);
    if (*bench) sdpa_cli::bench_command(bench_options);
    if (!std::cout.flush()) throw std::runtime_error("cannot write to standard output");  // e.g. disk full
  } catch (const std::exception& e) {
    // One line whatever the message holds, so scripts can rely on it.
    std::string message = e.what();
    for (char& c : message) {
      if (c == '\n' || c == '\r') c = ' ';
    }
    std::cerr << "sdpa: error: " << message << '\n';
    return 1;
  }
  return 0;
}
