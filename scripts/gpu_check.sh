#!/usr/bin/env bash
# The one-GPU check (docs/gpu.md), one part per call, each part sized for a GPU lent for minutes
# (at most 7 minutes wall on one H200 from a bare machine, wheel installs included):
#
#   bash scripts/gpu_check.sh PART [OUT_FOLDER] [options: gpu_check run's, e.g. --deadline 300;
#                                                  for `workflow` Snakemake's, e.g. -n]
#
#   PART  bert | gpt-neo | opt | llama: the cases of configs/gpu_check/PART.cfg (Slapo against
#         HF SDPA, HF + torch.compile, HF + liger-kernel, megatron-core and DeepSpeed ZeRO-3 on
#         one model), judged against the targets in slapo_ae/analysis/gpu_check.py;
#         workflow: the Snakemake workflow with the gpu-smoke profile (configs/config.yaml),
#         records, CSVs, figures and claims, on one GPU.
#
# It uses the python3 on PATH with its own PyTorch. Wheels in .whl/ (scripts/gpu_wheels.sh
# prepares them) are installed first, into a folder of their own, for machines that cannot reach
# a package index. Outputs go to OUT_FOLDER (default results/reference/<gpu>/<PART>); where $OUT
# is set (the device tool), a tarball of them, one of the profiles' traces, and the summary are
# copied there. Set SLAPO_AE_GIT_COMMIT to the commit the tree was copied from when it travels
# without .git. Without a GPU the script still runs, as a check of itself (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: scripts/gpu_check.sh PART [OUT_FOLDER] [options]; PART: bert, gpt-neo, opt, llama, workflow}
shift
if [[ $part != workflow && ! -f configs/gpu_check/$part.cfg ]]; then
  parts=$(cd configs/gpu_check && ls -- *.cfg | sed 's/\.cfg$//' | tr '\n' ' ')
  echo "scripts/gpu_check.sh: unknown part '$part'; parts: ${parts}workflow" >&2
  exit 2
fi
start=$SECONDS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  site=/tmp/slapo-gpu-site
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PYTHONPATH"
  export PATH="$site/bin:$PATH"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_BUILD_OPS=0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"
gpu=$(python3 -c "import torch; from slapo_ae.gpus import model_slug; \
print(model_slug(torch.cuda.get_device_name(0) if torch.cuda.is_available() else None))")
# OUT_FOLDER is optional: a first word that is an option leaves the default
out=results/reference/$gpu/$part
if [[ $# -gt 0 && $1 != -* ]]; then
  out=$1
  shift
fi
mkdir -p -- "$out"
python3 -c "import torch, transformers, deepspeed, megatron.core as m; print('torch', \
torch.__version__, 'cuDNN', torch.backends.cudnn.version(), 'transformers', \
transformers.__version__, 'deepspeed', deepspeed.__version__, 'megatron-core', m.__version__, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
# the analysis' packages come from the machine's image (the wheels carry none): say which
python3 -c "import importlib.metadata as md
for name in ('pandas', 'matplotlib', 'seaborn', 'snakemake'):
    try:
        print(name, md.version(name), end='; ')
    except md.PackageNotFoundError:
        print(name, 'missing', end='; ')
print()"
echo "set-up: $((SECONDS - start)) s"
status=0
if [[ $part == workflow ]]; then
  # The workflow's own outputs (results/, figures/) of the gpu-smoke profile, then a copy:
  # first the records, CSVs and figures; then, in what is left of the part's 7 minutes, the
  # rest of the DAG (the back-to-back recheck, the gaps profile and the claims). Targets come
  # before the options: --resources and --config take every word that follows them.
  # The rules run `python`; on the device machines only `python3` is sure to be the one with
  # PyTorch, so `python` is made to run it (a script: a link would lose its virtual env).
  shim=$(mktemp -d)
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v python3)" > "$shim/python"
  chmod +x "$shim/python"
  export PATH="$shim:$PATH"
  smk=(python3 -m snakemake)
  options=(--workflow-profile workflow/profiles/default --cores all --resources gpus=1
           --config profile=gpu-smoke)
  # Both runs end by the part's 400 s, so that what they made is always packed for $OUT (a
  # device call past its limit would bring back nothing from here).
  timeout $((400 - (SECONDS - start))) "${smk[@]}" figures/e2e.pdf figures/ablation.pdf \
    figures/table4.md "${options[@]}" "$@" 2>&1 | tee "$out/snakemake.log" \
    || status=${PIPESTATUS[0]}
  left=$((400 - (SECONDS - start)))
  if (( status == 0 && left > 30 )); then
    timeout "$left" "${smk[@]}" "${options[@]}" "$@" 2>&1 \
      | tee -a "$out/snakemake.log" || status=${PIPESTATUS[0]}
  else
    echo "claims not made: ${left} s of the part's 7 minutes left" | tee -a "$out/snakemake.log"
  fi
  for file in results/e2e.csv results/ablation.csv results/loc.csv results/claims.md \
              results/claims.json results/recheck.json results/gaps.json figures/e2e.pdf \
              figures/ablation.pdf figures/table4.md; do
    if [[ -f $file ]]; then cp "$file" "$out/"; else echo "not made: $file"; fi
  done
  # the rules' own logs: what a job killed by the part's timeout did last
  [[ -d results/logs ]] && cp -r results/logs "$out/rule-logs"
  for experiment in e2e ablation; do
    [[ -d results/$experiment/gpu-smoke ]] && cp -r "results/$experiment/gpu-smoke" "$out/$experiment"
  done
  summary=$out/claims.md
else
  python3 -m slapo_ae.analysis.gpu_check run "configs/gpu_check/$part.cfg" --out "$out" "$@" \
    || status=$?
  summary=$out/summary.md
fi
echo "part $part: $((SECONDS - start)) s, exit status $status"
if [[ -n "${OUT:-}" ]]; then
  # the profiles' Chrome traces in a tarball of their own: a file too large to come back
  # would then cost only them, not the records
  tar czf "$OUT/$part.tgz" --exclude='*.trace.json' -C "$(dirname "$out")" "$(basename "$out")"
  (cd "$(dirname "$out")" && find "$(basename "$out")" -name '*.trace.json' -print0 \
     | xargs -0r tar czf "$OUT/$part-traces.tgz")
  [[ -f $summary ]] && cp "$summary" "$OUT/$part-$(basename "$summary")"
fi
exit "$status"
