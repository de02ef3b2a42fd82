#!/usr/bin/env bash
# Runs every test: C++ (Release, then AddressSanitizer + UndefinedBehaviorSanitizer) and Python.
# Sets up and builds first (scripts/setup.sh --no-demo), so it works on a fresh clone.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-demo

echo "== C++ tests (Release)"
ctest --test-dir build --output-on-failure -j2

echo "== C++ tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSDPA_SANITIZE=address,undefined \
  -DSDPA_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan
ctest --test-dir build-asan --output-on-failure -j2

echo "== Python tests"
.venv/bin/python -m pytest -q python/tests
