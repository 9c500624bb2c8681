#!/usr/bin/env bash
# The wheels the GPU machine lacks, built here (where PyPI is reachable) for its Python 3.12 on x86-64, so that
# validate/gpu_check.sh installs them there offline (`pip install --no-index --find-links`): the lent H200 has
# torch 2.11 (CUDA 13), typer, pandas, matplotlib, numpy, packaging, psutil, py-cpuinfo, msgpack, ninja, einops,
# tqdm and nvidia-ml-py, but no pydantic and no DeepSpeed, and no network (/work/.library/device/KINDS.md).
#
#   validate/gpu_wheels.sh [DIR]      # default build/gpu_wheels (build/ is git-ignored: `carry` it)
#
# - pydantic, pydantic-core (manylinux x86_64, cp312), annotated-types, typing-inspection, typing-extensions:
#   the versions this machine's environment runs (read from it), so the GPU runs the code as tested here;
# - deepspeed 0.19.8 built here with DS_BUILD_OPS=0 (a pure-Python wheel: its ops JIT-build on first use, and the
#   CUDA runner, validate/engines/deepspeed_cuda.py, uses torch's Adam so that none is built) and hjson, its one
#   pure-Python dependency the GPU machine lacks; its others (numpy, packaging, psutil, py-cpuinfo, msgpack, ninja,
#   einops, tqdm, nvidia-ml-py, torch) are there.
# Every wheel is fetched with --no-deps: each dependency is named, one version each (two stop the install).
# Prints the directory's size; it must stay well under the 64 MiB a device call carries with the repo.
set -euo pipefail

dir=${1:-build/gpu_wheels}
mkdir -p "$dir"
py=${PYTHON:-python}
version() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
binary=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 "${platforms[@]}"
  --dest "$dir")
pure=(--no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none --platform any --dest "$dir")

"$py" -m pip download -q "${binary[@]}" "pydantic-core==$(version pydantic-core)"
for name in pydantic annotated-types typing-inspection typing-extensions hjson; do
  "$py" -m pip download -q "${pure[@]}" "$name==$(version "$name")"
done
if ! ls "$dir"/deepspeed-0.19.8-*.whl > /dev/null 2>&1; then  # an sdist on PyPI: build it, ops left out
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$dir" deepspeed==0.19.8
fi
ls -1 "$dir"
du -sh "$dir"
