"""Schedule for WideResNet (slapo_ae.zoo.wideresnet, or torchvision's, whose module names it
shares): bottleneck blocks ``layerK.N``.

Tensor parallelism splits the two convolutions that hold most of a block's work (for width
per group 128 the 3x3 ``conv2`` is 36/52 and ``conv1`` 8/52 of its FLOPs): ``conv1`` by output
channels, ``bn1`` with them (per-channel statistics need no communication), ``conv2`` by input
channels with its partial sums all-reduced, so ``bn2``, ``conv3``, ``bn3`` and the shortcut see
full, replicated tensors. Kernel optimisation has nothing to replace here (no attention, no
GeLU), so ``kernel_opt`` leaves the model as is.
"""

from __future__ import annotations

from . import checkpoint_layers
from .common import bottleneck_blocks, shard_batchnorm


def schedule(sch, opts) -> None:
    blocks = bottleneck_blocks(sch)
    if opts.tensor_parallel and sch.world_size > 1:
        for block in blocks:
            block["conv1"].shard("weight", axis=0)
            block["conv1"].sync("bwd_post", "all_reduce")
            shard_batchnorm(block["bn1"])  # over conv1's output channels
            block["conv2"].shard("weight", axis=1)
            block["conv2"].sync("fwd_post", "all_reduce")
    checkpoint_layers(blocks, opts.ckpt_ratio)
