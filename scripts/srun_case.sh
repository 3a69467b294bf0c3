#!/usr/bin/env bash
# One slapo-bench case over the nodes of a Slurm allocation: one `slapo-bench run` (one
# torchrun agent) per node through srun, all meeting at a c10d rendezvous on the first node.
#
#   sbatch --nodes 2 --gres gpu:8 --wrap \
#     "scripts/srun_case.sh --mode slapo-megatron --model bert-xlarge --gpus 16 --seq-len 512 \
#      --batch-size 64 --steps 40 --warmup 10 --dtype fp16 --out results/bert16.json"
#
# The options are those of `slapo-bench run` but --nodes and --rdzv-endpoint, which this
# script sets: the case's nodes are the allocation's (SLURM_JOB_NUM_NODES), or SLAPO_CASE_NODES
# tasks on fewer machines (a test on a one-machine cluster; the tasks then share the nodes).
# SLAPO_RDZV_PORT (default 29400) is the rendezvous port on the first node. SLAPO_HARNESS is
# the harness command each task runs (default .venv/bin/slapo-bench; the workflow's case runner
# passes its own, words split on spaces).
set -euo pipefail
: "${SLURM_JOB_ID:?run inside a Slurm allocation (sbatch or salloc)}"
# The job step of Snakemake's Slurm plugin keeps only the job's id of the SLURM_* variables:
# ask Slurm for the job's nodes then
if [[ -z ${SLURM_JOB_NUM_NODES:-} || -z ${SLURM_JOB_NODELIST:-} ]]; then
  job=$(scontrol show job --oneliner "$SLURM_JOB_ID")
  SLURM_JOB_NUM_NODES=$(sed -n 's/.* NumNodes=\([0-9]*\).*/\1/p' <<< "$job")
  SLURM_JOB_NODELIST=$(sed -n 's/.* NodeList=\([^ ]*\).*/\1/p' <<< "$job")
  : "${SLURM_JOB_NUM_NODES:?cannot read the nodes of job $SLURM_JOB_ID from scontrol}"
fi
cd "$(dirname "$0")/.."
nodes=${SLAPO_CASE_NODES:-$SLURM_JOB_NUM_NODES}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${SLAPO_RDZV_PORT:-29400}
if (( nodes == SLURM_JOB_NUM_NODES )); then
  spread=(--nodes "$nodes" --ntasks-per-node 1)
else
  spread=(--ntasks "$nodes" --overlap)
fi
read -ra harness <<< "${SLAPO_HARNESS:-.venv/bin/slapo-bench}"
exec srun "${spread[@]}" --kill-on-bad-exit=1 \
  "${harness[@]}" run --nodes "$nodes" --rdzv-endpoint "$head:$port" "$@"
