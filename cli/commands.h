// The subcommands of the `sdpa` tool. Each one has an add_*_command that declares it and its
// options on the app (binding them to an options struct that main owns), and a *_command
// that does the work after parsing. Errors are thrown (std::exception); main reports them.
#pragma once

#include <iosfwd>
#include <optional>
#include <string>

namespace CLI {
class App;
}

namespace sdpa_cli {

// `sdpa demo`: seed 000's toy attention head, computed and printed step by step.
CLI::App* add_demo_command(CLI::App& app);
void demo_command(std::ostream& out);

// `sdpa run`: attention on .npy files.
struct RunOptions {
  std::string q, k, v;
  std::string mask;  // empty: no mask
  std::string seqlens_k;  // empty: every sequence has Nk keys
  std::string causal = "none";
  std::string window;  // "L,R"; empty: no window
  std::optional<double> scale;
  double softcap = 0;                        // 0: off
  std::string softcap_order = "before_bias";  // or after_bias
  std::string alibi_slopes, sinks;            // .npy files; empty: none
  std::string block_mask;                     // .npy file (bool); empty: none
  std::string block_size = "128";             // "B" or "BQ,BK"
  std::string out;
  std::string weights;  // empty: not written
  std::string lse;      // empty: not written
};
CLI::App* add_run_command(CLI::App& app, RunOptions& options);
void run_command(const RunOptions& options);

// `sdpa bench`: the benchmark table (bench/cases.h) against the machine's measured peak.
struct BenchOptions {
  int threads = 0;  // 0: OpenMP's default
  int reps = 5;
  std::string filter;
  std::string dtype;  // "bf16", "f16", "f32", "f64": the whole table in it; empty: the default table
  bool json = false;
  bool no_avx512 = false;
  bool no_bf16_dot = false;
  bool no_amx = false;
};
CLI::App* add_bench_command(CLI::App& app, BenchOptions& options);
void bench_command(const BenchOptions& options);

// Room for later subcommands (`sdpa inspect`): add a pair of functions here and one line
// each in main.cc.

}  // namespace sdpa_cli
