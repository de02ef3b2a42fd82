#!/usr/bin/env bash
# Builds ggml's CPU backend from a ggml or llama.cpp source tree (kept outside this repository,
# never committed) and compiles bench/peers/ggml_decode.cc against it.
#   bench/peers/build_ggml.sh SRC_DIR [BUILD_DIR]   (default BUILD_DIR: SRC_DIR/build-sdpa-peers)
# SRC_DIR is the root of github.com/ggml-org/ggml, or of llama.cpp (its ggml/ subfolder is used).
# Builds at nice 19 with one job (JOBS=n to change) so that it does not starve other builds.
# Prints the driver's path: BUILD_DIR/ggml_decode.
set -euo pipefail
src=${1:?usage: build_ggml.sh SRC_DIR [BUILD_DIR]}
[[ -d $src/ggml/src ]] && src=$src/ggml
[[ -f $src/include/ggml.h ]] || { echo "build_ggml.sh: $src has no include/ggml.h" >&2; exit 2; }
out=${2:-$src/build-sdpa-peers}
here=$(cd "$(dirname "$0")" && pwd)
nice -n 19 cmake -S "$src" -B "$out" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DGGML_OPENMP=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF >/dev/null
nice -n 19 cmake --build "$out" --target ggml -j "${JOBS:-1}" >&2
libs=$(find "$out" -name 'libggml*.a' | sort -r)   # ggml, ggml-cpu, ggml-base
nice -n 19 g++ -O2 -std=c++17 -march=native -I"$src/include" "$here/ggml_decode.cc" \
  -o "$out/ggml_decode" -Wl,--start-group $libs -Wl,--end-group -lpthread -lm
echo "$out/ggml_decode"
