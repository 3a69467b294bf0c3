"""Benchmark: time of create_schedule + the TP schedule + build for a bert-large model.

    torchrun --nproc_per_node 2 benchmarks/bench_schedule.py [--model bert-large-uncased]

Building the model itself (random initialisation) is not timed. Target: under 2 s.
"""

import argparse
import time

import torch
import torch.distributed as dist

import slapo
from slapo.model_schedule import schedule_model
from slapo_ae.zoo import build_model, num_parameters


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-large-uncased")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    times = []
    for _ in range(args.repeat):
        model = build_model(args.model)
        dist.barrier()
        start = time.perf_counter()
        sch = slapo.create_schedule(model)
        schedule_model(sch, tensor_parallel=True, kernel_opt=False)
        model = slapo.build_module(sch)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(f"{args.model}: {num_parameters(model) / 1e6:.0f}M parameters per rank on "
              f"{dist.get_world_size()} ranks; create_schedule + TP schedule + build: "
              f"median {sorted(times)[len(times) // 2]:.3f} s over {args.repeat} runs "
              f"(min {min(times):.3f}, max {max(times):.3f}); target < 2 s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
