// Google Benchmark over the shared case table: the fused kernel and, in the same process,
// the naive materialising kernel as a baseline. Counters: GFLOP/s by flop_count()
// (4·B·Hq·Nq·Nk·D, halved for causal) and K/V read bandwidth.
//   build/bench/bench_attention --benchmark_filter=d64
#include <benchmark/benchmark.h>

#include "cases.h"

namespace {

void run_case(benchmark::State& state, const sdpa::bench::BenchCase& c, sdpa::Backend backend) {
  sdpa::bench::CaseData data(c);
  data.run(backend);
  for (auto _ : state) data.run(backend);
  state.counters["GFLOP/s"] =
      benchmark::Counter(sdpa::bench::flop_count(c) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["KV_GB/s"] =
      benchmark::Counter(sdpa::bench::kv_bytes(c) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

int register_all() {
  for (const auto& c : sdpa::bench::default_cases()) {
    benchmark::RegisterBenchmark(("flash/" + c.name).c_str(), run_case, c, sdpa::Backend::kFlash)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("naive/" + c.name).c_str(), run_case, c, sdpa::Backend::kNaive)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->Iterations(1);
  }
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
