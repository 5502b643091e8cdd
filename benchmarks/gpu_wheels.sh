#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for benchmarks/gpu_check.sh, downloaded where pip reaches the package
# registry, into .whl/ (git ignores it) for `run(command="bash benchmarks/gpu_check.sh", carry=[".whl"])`.
#
#   bash benchmarks/gpu_wheels.sh [DIR]     # default .whl; PYTHON=... picks the interpreter whose pip runs
#
# That machine's python3 (3.12) has torch, accelerate, safetensors, huggingface-hub, tensorboard and the
# rest of what dit_accel imports, but not diffusers (docs/benchmarks.md, "What the machine has"). diffusers
# is pure Python (py3-none-any), so the file installs on any Python 3, and the machine has everything it
# needs but importlib_metadata, which it imports only on Python < 3.8 (and whose newest release would bring
# lazy-importer, missing too): not fetched. Nor is datasets, which only an image folder (--data-path) needs:
# the check trains on a latent cache.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
"${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 -d "$dest" "diffusers==${DIFFUSERS_VERSION:-0.42.1}"
# torchao, for the check's FP8 stage (dit-accel train --fp8): a cp310-abi3 wheel, so any CPython >= 3.10; its
# C++ extensions want torch >= 2.11 (the machine's), and its float8 training needs none of them.
"${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$dest" "torchao==${TORCHAO_VERSION:-0.18.0}"
ls "$dest"
