#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index (scripts/gpu_check.sh installs
# them from .whl/): the project's pins that such a machine's PyTorch image lacks, for CPython
# 3.12 on x86-64. Run here, where PyPI is reachable, from the repository root, after `make venv`.
# PyTorch itself is the machine's own (CUDA builds are too large to carry).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# Same versions as pyproject.toml and the venv; DeepSpeed's dependencies that such an image
# lacks (pydantic and its parts, hjson); transformers' own are there (huggingface-hub >= 1.31).
pin() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=()
for name in transformers megatron-core hjson pydantic pydantic-core annotated-types \
            typing-inspection typing-extensions; do
  pkgs+=("$name==$(pin "$name")")
done
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dest" "${pkgs[@]}"
# DeepSpeed ships only a source archive: build a pure-Python wheel (ops compiled on first use).
DS_BUILD_OPS=0 .venv/bin/python -m pip wheel --quiet --no-deps --no-build-isolation -w "$dest" \
  "deepspeed==$(pin deepspeed)"
ls -l "$dest"
du -sh "$dest"
