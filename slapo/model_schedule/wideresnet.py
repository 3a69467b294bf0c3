"""Schedule for WideResNet (slapo_ae.zoo.wideresnet): bottleneck blocks ``layerK.N``.

Tensor parallelism splits the two convolutions that hold most of a block's work (for width
per group 128 the 3x3 ``conv2`` is 36/52 and ``conv1`` 8/52 of its FLOPs): ``conv1`` by output
channels, ``bn1`` with them (per-channel statistics need no communication), ``conv2`` by input
channels with its partial sums all-reduced, so ``bn2``, ``conv3``, ``bn3`` and the shortcut see
full, replicated tensors. Kernel optimisation has nothing to replace here (no attention, no
GeLU), so ``kernel_opt`` leaves the model as is.
"""

from __future__ import annotations

from . import checkpoint_layers
from .common import shard_batchnorm, shard_column_row, tensor_parallel


def schedule(sch, opts) -> None:
    stages = sch.mod.config.layers
    blocks = [sch[f"layer{k + 1}.{j}"] for k, n in enumerate(stages) for j in range(n)]
    if tensor_parallel(sch, opts):
        for block in blocks:
            shard_column_row(block, ["conv1"], "conv2", input_sync="conv1")
            shard_batchnorm(block["bn1"])
    checkpoint_layers(sch, [block.path for block in blocks], opts.ckpt_ratio)
