"""Quick start: schedule a model for tensor parallelism and check it against the plain one.

    torchrun --nproc_per_node 2 examples/quickstart.py

Runs on CPU ranks over gloo (or GPUs over NCCL when each rank has one). Prints, on rank 0,
the loss of the plain and the scheduled model for 3 training steps, the relative error of the
logits and the largest relative gradient error (sharded logits and gradients gathered back to
full shape). tests/distributed/test_examples.py runs it.
"""

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

import slapo
from slapo.model_schedule import schedule_model
from slapo.verify import train_side_by_side
from slapo_ae.zoo import build_model, no_dropout, synthetic_batch


def say(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def mlp_demo(device):
    """The primitives by hand: a Megatron-style MLP over all ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(device)
    sch = slapo.create_schedule(model)
    sch["0"].shard("weight", axis=0)            # column parallel: the bias follows
    sch["0"].sync("bwd_post", "all_reduce")     # its input gradient is a partial sum
    sch["2"].shard("weight", axis=1)            # row parallel
    sch["2"].sync("fwd_post", "all_reduce")     # its output is a partial sum
    model = slapo.build_module(sch)
    say(f"MLP on {sch.world_size} ranks: first weight {tuple(model[0].weight.shape)} per rank, "
        f"output {tuple(model(torch.randn(2, 64, device=device)).shape)}")


def loss_and_logits(model, batch):
    out = model(**batch)
    return out.loss, out.logits


def bert_demo(device, name="bert-tiny", steps=3):
    """A model schedule from the library, checked numerically against the plain model."""
    plain = build_model(name, device=device, seed=0, **no_dropout(name))
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule_model(sch, tensor_parallel=True, ckpt_ratio=0.5)
    scheduled = slapo.build_module(sch)
    batches = [synthetic_batch(name, batch_size=4, seq_len=64, device=device, seed=step)
               for step in range(steps)]
    reports = train_side_by_side(plain, scheduled, batches, loss_and_logits)
    for step, report in enumerate(reports):
        worst, error = report.max_grad_error
        say(f"{name} step {step}: loss plain {report.loss_plain:.6f} scheduled "
            f"{report.loss_scheduled:.6f}; logits error {report.output_error:.1e}; "
            f"largest gradient error {error:.1e} ({worst})")


def main():
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    say("primitives:", ", ".join(slapo.list_primitives()))
    mlp_demo(device)
    bert_demo(device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
