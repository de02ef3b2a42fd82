// The subcommands of the `sdpa` tool. Each one has an add_*_command that declares it and its
// options on the app (binding them to an options struct that main owns), and a *_command
// that does the work after parsing. Errors are thrown (std::exception); main reports them.
#pragma once

#include <iosfwd>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "npy.h"
#include "sdpa/attention.h"
#include "storage.h"

namespace CLI {
class App;
}

namespace sdpa_cli {

// `sdpa demo`: seed 000's toy attention head, computed and printed step by step.
CLI::App* add_demo_command(CLI::App& app);
void demo_command(std::ostream& out);

// The call that `sdpa run` and `sdpa inspect` read from .npy files: its options,
struct CallOptions {
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
  std::string precision = "exact";            // or fast (16-bit inputs)
};
// declared on a subcommand (--q, --k and --v required or not),
void add_call_options(CLI::App* command, CallOptions& options, bool required);

// an input file and its array, Messages call it by label(): "k (k.npy)".
struct Input {
  std::string name, path;
  NpyArray array;

  std::string label() const { return name + " (" + path + ")"; }
  const std::vector<int64_t>& shape() const { return array.shape; }
  bool is_float() const { return sdpa::internal::is_float_dtype(array.dtype); }
};

// and the call read and checked (sdpa::validate), with the arrays its views point into.
struct LoadedCall {
  Input q, k, v;
  std::optional<Input> mask, seqlens, slopes, sinks, block_mask;
  sdpa::Inputs inputs;
  sdpa::Options options;
  std::string files;  // "q = q.npy, k = ...": added to the library's errors
  std::runtime_error with_files(const sdpa::Error& e) const;
};
// Floats are converted as `sdpa run --help` says (float32 beside float64 to float64, ...).
LoadedCall load_call(const CallOptions& options);
extern const char* const kDtypesFooter;  // that rule, for --help

// `sdpa run`: attention on .npy files.
struct RunOptions : CallOptions {
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
  std::string precision = "exact";  // or fast: Options::precision of every case
  bool batch_invariant = false;      // Options::batch_invariant of every case
  bool json = false;
  bool no_avx512 = false;
  bool no_bf16_dot = false;
  bool no_amx = false;
};
CLI::App* add_bench_command(CLI::App& app, BenchOptions& options);
void bench_command(const BenchOptions& options);

// `sdpa inspect`: an HTML report of the call's weights (inspect.h), or of seed 000's toy head.
struct InspectOptions : CallOptions {
  bool demo = false;
  std::string out = "attention_report.html";
  int64_t topk = 8, cells = 512, max_heads = 16;
  bool progress = true;  // a progress bar on stderr when it is a terminal
};
CLI::App* add_inspect_command(CLI::App& app, InspectOptions& options);
void inspect_command(const InspectOptions& options);

}  // namespace sdpa_cli
