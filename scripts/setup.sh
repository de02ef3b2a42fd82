#!/usr/bin/env bash
# Installs what is missing, builds everything and runs `sdpa demo`. Safe to run again.
#   scripts/setup.sh            set up, build, demo
#   scripts/setup.sh --no-demo  set up and build only
#   scripts/setup.sh --torch    also install torch (python/requirements-test.txt) before the
#                               package, so that sdpa.torch's operators are built with it
#                               (scripts/test.sh uses --no-demo --torch)
set -euo pipefail
cd "$(dirname "$0")/.."
demo=1; torch=0
for arg in "$@"; do
  case "$arg" in
    --no-demo) demo=0 ;;
    --torch) torch=1 ;;
    *) echo "setup: unknown option $arg (--no-demo, --torch)" >&2; exit 2 ;;
  esac
done

# 1. Debian packages: compilers (clang + LLVM OpenMP for the ThreadSanitizer build), CMake, Highway
#    (SIMD), CLI11, GoogleTest, Google Benchmark, OpenMP; ccache (the Python package and the
#    Release build then compile the kernels once); libpng (sdpa inspect's pictures) and chromium
#    (the test that renders an inspect report in a real headless browser); OpenBLAS built for
#    OpenMP (the multi-head layer's matrix products, loaded at run time: src/layer/blas.h);
#    OpenMPI (ring attention over MPI: the library sdpa_mpi and its tests under mpirun, and
#    mpi4py's sdpa.distributed; the library sdpa and the Python package do not link it).
packages=(build-essential cmake ninja-build ccache python3-venv clang libclang-rt-14-dev libomp-dev
          libhwy-dev libcli11-dev libgtest-dev libbenchmark-dev libpng-dev chromium
          libopenblas0-openmp openmpi-bin libopenmpi-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

# One C++ compiler for the Python package and the C++ build: with the same compiler, path and
# flags, ccache compiles the library once for both (pip's build alone picked g++, CMake's c++,
# and ccache hashes the compiler's name).
export CC="${CC:-gcc}" CXX="${CXX:-g++}"

# 2. The Python environment .venv with the package installed (and the sdpa CLI on its PATH).
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r python/requirements-dev.txt
if [ "$torch" = 1 ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r python/requirements-test.txt
fi
# --no-build-isolation: the build sees .venv's packages (nanobind, and torch when installed,
# for the torch operators of sdpa.torch: python/CMakeLists.txt).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation .

# 3. The C++ build: library, CLI, tests, benchmarks (and sdpa_mpi, as MPI is installed).
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build

if [ "$demo" = 1 ]; then
  .venv/bin/sdpa demo
fi
