#!/usr/bin/env bash
# Developer shortcut: rebuild the Python package's native parts in build/python (the directory
# `pip install .` configured) and copy them, with python/sdpa/*.py, into .venv's installed
# package, without a whole `pip install` (which rebuilds from scratch). Run setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
ninja -C build/python
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")/sdpa
cp build/python/python/_core*.so build/python/python/libsdpa.so "$site/"
[ -f build/python/python/_torch_ops.so ] && cp build/python/python/_torch_ops.so "$site/"
cp python/sdpa/*.py "$site/"
# The installed modules find libsdpa.so beside them ($ORIGIN); the build tree's may point into
# build/python, which is fine for this copy too.
echo "installed into $site"
