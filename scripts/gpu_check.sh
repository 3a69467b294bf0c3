#!/usr/bin/env bash
# The one-GPU check (docs/gpu.md): Slapo against HF SDPA, HF + torch.compile,
# megatron-core and DeepSpeed ZeRO-3 on one GPU, judged against the targets in
# slapo_ae/analysis/gpu_check.py. Run from anywhere in the repository on a machine with one CUDA GPU:
#
#   bash scripts/gpu_check.sh [OUT_FOLDER] [gpu_check run options, e.g. --budget 600]
#
# It uses the python3 on PATH with its own PyTorch. Wheels in .whl/ (scripts/gpu_wheels.sh
# prepares them) are installed first, into a folder of their own, for machines that cannot reach
# a package index. Records, logs and summary.md go to OUT_FOLDER (default
# results/reference/<gpu>); where $OUT is set, a tarball of them and summary.md are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  site=/tmp/slapo-gpu-site
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PYTHONPATH"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_BUILD_OPS=0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower())")
out=${1:-results/reference/$gpu}
shift || true
python3 -c "import torch, transformers, deepspeed, megatron.core as m; print('torch', \
torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, \
'megatron-core', m.__version__, torch.cuda.get_device_name(0))"
status=0
python3 -m slapo_ae.analysis.gpu_check run configs/gpu_check/one_gpu.cfg --out "$out" "$@" || status=$?
if [[ -n "${OUT:-}" ]]; then
  tar czf "$OUT/records.tgz" -C "$(dirname "$out")" "$(basename "$out")"
  cp "$out/summary.md" "$OUT/"
fi
exit "$status"
