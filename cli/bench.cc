// `sdpa bench`: the shared case table (bench/cases.h) timed on this machine, next to what the
// machine can do, measured in the same run: the FMA peak and the memory read bandwidth.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "cases.h"
#include "commands.h"
#include "front_options.h"
#include "machine.h"
#include "sdpa/attention.h"

namespace sdpa_cli {
namespace {

// The type column: the 8-bit cache's type for its cases (float32 q), else the inputs' dtype.
sdpa::DType shown_type(const sdpa::bench::BenchCase& c) {
  return c.kv == sdpa::DType::kInt8 || c.kv == sdpa::DType::kUInt8 ? c.kv : c.dtype;
}


const char* mask_name(sdpa::bench::MaskKind m) {
  switch (m) {
    case sdpa::bench::MaskKind::kNone: return "none";
    case sdpa::bench::MaskKind::kBool: return "bool";
    case sdpa::bench::MaskKind::kAdditive: return "additive";
    case sdpa::bench::MaskKind::kKeyPadding: return "keypad";
  }
  return "?";
}

const char* causal_name(sdpa::Causal c) { return sdpa::front::name_of(sdpa::front::kCausalNames, c).data(); }

struct Row {
  sdpa::bench::BenchCase c;
  double seconds, gflops, kv_gbs;
  const char* path;  // the instruction path the case's calls ran (sdpa::last_kernel_path)
};

}  // namespace

CLI::App* add_bench_command(CLI::App& app, BenchOptions& options) {
  CLI::App* cmd = app.add_subcommand("bench", "Time the benchmark table: GFLOP/s, share of peak, bandwidth");
  // CLI::Range rather than CLI::PositiveNumber, whose error message spells out DBL_MAX.
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  cmd->add_option("--threads", options.threads, "Threads (default: OpenMP's, i.e. all cores)")
      ->check(CLI::Range(0, kMaxInt));
  cmd->add_option("--reps", options.reps, "Timed runs per case; the median is reported")->check(CLI::Range(1, kMaxInt));
  cmd->add_option("--filter", options.filter, "Only cases whose name contains this text");
  cmd->add_option("--dtype", options.dtype,
                  "Every case in this dtype (q, k, v, out; lse float32, float64 for f64) instead of the default "
                  "table: float32, then the cases named 'bf16' in bfloat16 (bf16 and f16 also run the 8-bit cache's "
                  "cases with 16-bit q)")
      ->check(CLI::IsMember({"bf16", "f16", "f32", "f64"}))
      ->type_name("DTYPE");
  cmd->add_option("--precision", options.precision,
                  "Options::precision of every case: exact, or fast (16-bit cases round the weights before p.V; "
                  "float32 and float64 cases are unchanged by it)")
      ->check(CLI::IsMember(sdpa::front::names_of(sdpa::front::kPrecisionNames)))
      ->type_name("MODE")
      ->capture_default_str();
  cmd->add_flag("--batch-invariant", options.batch_invariant,
                "Options::batch_invariant in every case (a row's bits independent of how it is batched)");
  cmd->add_flag("--json", options.json, "Print JSON instead of a table");
  cmd->add_flag("--no-avx512", options.no_avx512, "Dispatch to AVX2 at most, as on a CPU without AVX-512");
  cmd->add_flag("--no-bf16-dot", options.no_bf16_dot,
                "Do not use AVX512_BF16's or AMX's dot products for bfloat16 (sdpa::set_max_kernel_path(kSimd))");
  cmd->add_flag("--no-amx", options.no_amx,
                "Do not use AMX tiles for bfloat16 (sdpa::set_max_kernel_path(kAvx512Bf16))");
  return cmd;
}

void bench_command(const BenchOptions& options) {
  if (options.no_avx512) sdpa::bench::disable_avx512();
  if (options.no_amx) sdpa::set_max_kernel_path(sdpa::KernelPath::kAvx512Bf16);
  if (options.no_bf16_dot) sdpa::set_max_kernel_path(sdpa::KernelPath::kSimd);
  if (options.threads > 0) sdpa::set_num_threads(options.threads);
  const int threads = sdpa::num_threads();
  std::vector<sdpa::bench::BenchCase> cases;
  const auto dtype = sdpa::bench::dtype_of_tag(options.dtype);  // CLI11 has checked the tag
  for (const auto& c : dtype ? sdpa::bench::cases_in(*dtype) : sdpa::bench::default_cases()) {
    if (c.name.find(options.filter) != std::string::npos) cases.push_back(c);
  }
  const sdpa::Precision precision = sdpa::front::parse_name("precision", sdpa::front::kPrecisionNames, options.precision);
  for (auto& c : cases) c.precision = precision, c.batch_invariant = options.batch_invariant;
  if (cases.empty()) throw std::runtime_error("--filter '" + options.filter + "' matches no case");
  std::string dtypes;  // the dtypes of the cases, as the header names them: "float32, bfloat16"
  for (const auto& c : cases) {
    const std::string name = sdpa::dtype_name(c.dtype);
    if ((", " + dtypes + ", ").find(", " + name + ", ") == std::string::npos) {
      dtypes += (dtypes.empty() ? "" : ", ") + name;
    }
  }

  // Progress on stderr: one line rewritten in place on a terminal, plain lines to a log.
  const bool tty = isatty(STDERR_FILENO);
  const auto progress = [tty](const std::string& text) {
    if (tty) {
      std::cerr << "\r\033[K" << text << std::flush;
    } else if (!text.empty()) {
      std::cerr << text << '\n';
    }
  };
  progress("measuring the machine (FMA peak, read bandwidth)...");
  const double peak = sdpa::bench::measure_fma_peak_gflops(threads);
  const double bandwidth = sdpa::bench::measure_read_bandwidth_gbs(threads);
  std::vector<Row> rows;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    progress("[" + std::to_string(i + 1) + "/" + std::to_string(cases.size()) + "] " + c.name + "...");
    sdpa::bench::CaseData data(c);
    const double t = sdpa::bench::median_seconds(data, options.reps);
    const sdpa::KernelPath ran = sdpa::last_kernel_path();
    const char* path = ran == sdpa::KernelPath::kAmxBf16 ? "amx" : ran == sdpa::KernelPath::kAvx512Bf16 ? "bf16dot" : "simd";
    rows.push_back({c, t, sdpa::bench::flop_count(c) / t / 1e9, sdpa::bench::kv_bytes(c) / t / 1e9, path});
  }
  progress("");

  const std::string target = sdpa::bench::simd_target();
  if (options.json) {
    std::printf("{\"threads\": %d, \"simd_target\": \"%s\", \"precision\": \"%s\", \"batch_invariant\": %s, "
                "\"fma_peak_gflops\": %.2f, \"read_bandwidth_gbs\": %.2f,\n",
                threads, target.c_str(), options.precision.c_str(), options.batch_invariant ? "true" : "false", peak,
                bandwidth);
    std::printf(" \"flops_formula\": \"4*B*Hq*Nq*Nk*D (backward: 10*B*Hq*Nq*Nk*D), halved for causal; with a window, "
                "Nq*Nk counts the (i, j) pairs it and causal allow; the same for every dtype\",\n \"cases\": [\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      std::printf(
          "  {\"name\": \"%s\", \"dtype\": \"%s\", \"B\": %lld, \"Hq\": %lld, \"Hkv\": %lld, \"Nq\": %lld, "
          "\"Nk\": %lld, \"D\": %lld, "
          "\"mask\": \"%s\", \"causal\": \"%s\", \"window\": [%lld, %lld], \"median_ms\": %.4f, "
          "\"gflops\": %.2f, \"peak_share\": %.4f, \"kv_gbs\": %.2f, \"bandwidth_share\": %.4f, \"path\": \"%s\"}%s\n",
          r.c.name.c_str(), sdpa::bench::dtype_tag(shown_type(r.c)), (long long)r.c.B, (long long)r.c.Hq, (long long)r.c.Hkv,
          (long long)r.c.Nq, (long long)r.c.Nk, (long long)r.c.D, mask_name(r.c.mask), causal_name(r.c.causal),
          (long long)r.c.window.left, (long long)r.c.window.right, r.seconds * 1e3, r.gflops, r.gflops / peak, r.kv_gbs,
          r.kv_gbs / bandwidth, r.path, i + 1 < rows.size() ? "," : "");
    }
    std::printf(" ]}\n");
    return;
  }
  std::printf("sdpa bench: %d threads, SIMD target %s, %s, precision %s%s, median of %d runs\n", threads,
              target.c_str(), dtypes.c_str(), options.precision.c_str(), options.batch_invariant ? ", batch invariant" : "",
              options.reps);
  std::printf("machine (measured now, %d threads): FMA peak %.1f GFLOP/s, read bandwidth %.1f GB/s\n", threads,
              peak, bandwidth);
  std::printf(
      "GFLOP/s = 4*B*Hq*Nq*Nk*D / median time (backward: 10*B*Hq*Nq*Nk*D), halved for causal;\n"
      "  with a window, Nq*Nk counts the (i, j) pairs it and causal allow; the same for every dtype;\n"
      "KV GB/s = bytes of K and V (in the case's dtype; an 8-bit cache's values and float32 scales and zero points) / time\n\n");
  std::printf("%-32s %-4s %3s %3s %3s %5s %6s %4s %-8s %-12s %9s %8s %6s %8s %5s %s\n", "case", "type", "B", "Hq",
              "Hkv", "Nq", "Nk", "D", "mask", "causal", "median ms", "GFLOP/s", "%peak", "KV GB/s", "%bw", "path");
  for (const auto& r : rows) {
    const bool decode = sdpa::bench::is_decode(r.c);
    std::printf("%-32s %-4s %3lld %3lld %3lld %5lld %6lld %4lld %-8s %-12s %9.4f %8.1f %5.1f%% ", r.c.name.c_str(),
                sdpa::bench::dtype_tag(shown_type(r.c)), (long long)r.c.B, (long long)r.c.Hq, (long long)r.c.Hkv,
                (long long)r.c.Nq, (long long)r.c.Nk, (long long)r.c.D, mask_name(r.c.mask), causal_name(r.c.causal),
                r.seconds * 1e3, r.gflops, 100 * r.gflops / peak);
    if (decode) {
      std::printf("%8.1f %4.0f%% %s\n", r.kv_gbs, 100 * r.kv_gbs / bandwidth, r.path);
    } else {
      std::printf("%8s %5s %s\n", "-", "-", r.path);
    }
  }
}

}  // namespace sdpa_cli
