"""fork_rng: run a module under a per-rank random stream."""

from __future__ import annotations

import functools

import torch

from ..hooks import outside_graphs
from ..random import STREAM_SEED_OFFSET, TENSOR_PARALLEL, rng_streams
from . import register_primitive


@register_primitive()
def fork_rng(sch, stream: str = TENSOR_PARALLEL, seed: int | None = None) -> None:
    """Draw random numbers in this module from a stream of its own on each rank.

    Inside tensor-parallel regions activations are sharded, so dropout must differ across
    ranks; outside them activations are replicated and dropout must agree, which it does when
    every rank seeds the default generator alike. The stream is seeded with
    ``seed + 2718 + rank`` (``seed`` defaults to ``torch.initial_seed()``) the first time it is
    used, unless ``slapo.random.manual_seed`` created it already.

    Example::

        sch["encoder.layer.0.attention.self"].fork_rng()   # attention-probability dropout
    """
    streams = rng_streams()
    if not streams.has(stream):
        base = torch.initial_seed() if seed is None else seed
        # a seed given here is the user's choice, even one another stream has
        streams.add(stream, base + STREAM_SEED_OFFSET + sch.rank, unique_seed=False)
    inner = sch.mod.forward

    @outside_graphs(recursive=False)  # the stream switch is eager, the forward inside compiles
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with streams.fork(stream):
            return inner(*args, **kwargs)

    sch.mod.forward = forward
