#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index (scripts/gpu_check.sh installs
# them from .whl/): the project's pins that such a machine's PyTorch image lacks, for CPython
# 3.12 on x86-64. Run here, where PyPI is reachable, from the repository root, after `make venv`
# (and `.venv/bin/pip install liger-kernel==<the gpu extra's pin> --no-deps`, for its version).
# PyTorch and Triton are the machine's own (CUDA builds are too large to carry); so are the
# packages its image has (numpy, pandas, matplotlib, seaborn, pyyaml, jinja2, requests,
# psutil, ...). What travels must stay under the device tool's 64 MiB; the script prints the size.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
pin() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# The harness: transformers, megatron-core, DeepSpeed and DeepSpeed's dependencies that such an
# image lacks; liger-kernel for hf-liger (its pin: pyproject.toml's gpu extra). Also the small
# ones the device image had on 2026-11-17 (einops, msgpack, ninja, py-cpuinfo; attrs and wrapt
# for the workflow): without them `import deepspeed` and the Snakefile stop (a rehearsal on
# CPU, 2026-12-06, in a Python 3.12 environment lacking them), and 1 MB buys independence
# from the image's list.
harness=(transformers megatron-core deepspeed hjson pydantic pydantic-core annotated-types
         typing-inspection typing-extensions liger-kernel einops msgpack ninja py-cpuinfo)
# The workflow (part `workflow`): Snakemake and what it needs beyond the image's packages.
workflow=(attrs wrapt snakemake snakemake-interface-common snakemake-interface-executor-plugins
          snakemake-interface-logger-plugins snakemake-interface-report-plugins
          snakemake-interface-scheduler-plugins snakemake-interface-storage-plugins
          argparse-dataclass conda-inject configargparse connection-pool docutils dpath
          fastjsonschema gitdb gitpython greenlet humanfriendly immutables jsonschema
          jsonschema-specifications jupyter-core nbformat platformdirs pulp referencing rpds-py
          smart-open smmap sqlalchemy sqlmodel tenacity throttler traitlets yte)
liger_pin=$(sed -n 's/.*"liger-kernel==\([^"]*\)".*/\1/p' pyproject.toml)
for name in "${harness[@]}" "${workflow[@]}"; do
  if [[ $name == liger-kernel ]]; then version=$liger_pin; else version=$(pin "$name"); fi
  # A binary wheel where PyPI has one; else a pure-Python wheel built from the source archive
  # (DeepSpeed: its ops compile on first use, DS_BUILD_OPS=0).
  .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dest" "$name==$version" 2>/dev/null \
  || DS_BUILD_OPS=0 .venv/bin/python -m pip wheel --quiet --no-deps --no-build-isolation \
       -w "$dest" "$name==$version"
done
ls -l "$dest"
du -sh "$dest"
