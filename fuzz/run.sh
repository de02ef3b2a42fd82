#!/usr/bin/env bash
# Builds the fuzz targets (clang, ASan + UBSan, in build-fuzz/) and runs each for a while.
#
#   fuzz/run.sh [SECONDS]     total time, split between the targets (default 120: 90 s for
#                             attention_fuzz, 30 s for npy_fuzz)
#
# Environment: BUILD_DIR (default build-fuzz), SCRATCH (default /tmp/sdpa-fuzz: new corpus
# entries, crash files and logs; the committed seeds in fuzz/corpus/ are only read),
# SDPA_FUZZ_STRICT=1 (every check fatal, KNOWN ones too; see attention/main.cc), FUZZ_SEED (libFuzzer's
# -seed; 0, the default, picks one at random; CI sets 1 so that its inputs are the same each
# run, in the same order: run `FUZZ_SEED=1 SCRATCH=$(mktemp -d) fuzz/run.sh 360` to cover them).
# Exits non-zero when a target crashes, hangs, leaks or fails a check; the reproducer is then
# under $SCRATCH/artifacts/ (rerun it with: build-fuzz/fuzz/attention_fuzz FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
total=${1:-120}
build=${BUILD_DIR:-build-fuzz}
scratch=${SCRATCH:-/tmp/sdpa-fuzz}

if [ ! -f "$build/build.ninja" ] && [ ! -f "$build/Makefile" ]; then
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  CC=clang CXX=clang++ cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSDPA_SANITIZE=address,undefined -DSDPA_BUILD_FUZZ=ON -DSDPA_BUILD_TESTS=OFF \
    -DSDPA_BUILD_BENCH=OFF -DSDPA_BUILD_CLI=OFF
fi
cmake --build "$build" --target attention_fuzz npy_fuzz -j "${JOBS:-2}"

mkdir -p "$scratch/attention" "$scratch/npy" "$scratch/artifacts"
t_att=$(( total * 3 / 4 )); t_npy=$(( total - t_att ))
[ "$t_att" -ge 1 ] || t_att=1
[ "$t_npy" -ge 1 ] || t_npy=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
run() {  # name seconds corpus-dir [extra flags]
  local name=$1 secs=$2 seeds=$3; shift 3
  echo "== $name for ${secs}s (log: $scratch/$name.log)"
  if "$build/fuzz/$name" "$scratch/${seeds}" "fuzz/corpus/${seeds}" -max_total_time="$secs" -timeout=10 \
      -seed="${FUZZ_SEED:-0}" \
      -rss_limit_mb=2048 -malloc_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$scratch/artifacts/$name-" \
      "$@" >"$scratch/$name.log" 2>&1; then
    grep -E "stat::number_of_executed_units|stat::average_exec_per_sec|KNOWN" "$scratch/$name.log" || true
  else
    status=1
    echo "!! $name FAILED; last lines of $scratch/$name.log:"
    tail -n 60 "$scratch/$name.log"
  fi
}
# FUZZ_RUNS also bounds attention_fuzz by a number of inputs (whichever limit comes first): with
# FUZZ_SEED fixed, CI then tries the same inputs however fast its machine is.
run attention_fuzz "$t_att" attention -max_len=512 ${FUZZ_RUNS:+-runs=$FUZZ_RUNS}
run npy_fuzz "$t_npy" npy -max_len=4096
exit $status
