"""Named random-number streams, swapped in for the default generator around a region.

Tensor parallelism needs two kinds of randomness: dropout on replicated activations must draw
the same mask on every rank (the default generator, seeded alike everywhere), while dropout on
sharded activations must draw independent masks per rank (a per-rank stream). ``fork_rng``
runs a module under such a stream; ``checkpoint`` records and restores the streams so that a
recomputed forward draws the same masks as the original one.
"""

from __future__ import annotations

import contextlib

import torch

# Offset added to the base seed for per-rank streams, so that they never coincide with the
# default generator's stream.
STREAM_SEED_OFFSET = 2718
# The per-rank stream of tensor parallelism (fork_rng's default), under upstream Slapo's and
# Megatron-LM's name (get_states() lists it so); "tensor_parallel" is accepted for it too.
TENSOR_PARALLEL = "model-parallel-rng"
_ALIASES = {"tensor_parallel": TENSOR_PARALLEL}


def _canonical(name: str) -> str:
    return _ALIASES.get(name, name)


class RNGStreams:
    """Generator states by stream name (Megatron-LM's ``CudaRNGStatesTracker`` contract).

    Each stream holds the CPU generator's state and, when CUDA is in use, the current CUDA
    device's. ``get_states``/``set_states`` speak Megatron-LM's form, one state per name: the
    state of the generator the streams drive (CUDA's where it is in use, else the CPU's).
    As there, a name and a seed serve one stream each (``add`` raises otherwise);
    ``reset`` forgets all, and ``slapo.set_random_seed`` seeds its stream anew each time."""

    def __init__(self):
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        self._seeds: dict[str, int] = {}

    def has(self, name: str) -> bool:
        return _canonical(name) in self._states

    def reset(self) -> None:
        """Forget every stream and seed."""
        self._states, self._seeds = {}, {}

    def add(self, name: str, seed: int, *, unique_seed: bool = True) -> None:
        """Create stream ``name`` from ``seed`` without touching the default state; a name or
        (unless ``unique_seed=False``) a seed that another stream has is an error, as in
        Megatron-LM's tracker."""
        name = _canonical(name)
        if name in self._states:
            raise ValueError(f"random stream {name!r} exists already (reset() or discard() it "
                             "first, or use another name)")
        if unique_seed and seed in self._seeds.values():
            raise ValueError(f"seed {seed} seeds another random stream already; streams need "
                             "seeds of their own")
        state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.Generator(device="cuda").manual_seed(seed).get_state()
        self._states[name], self._seeds[name] = state, seed

    def discard(self, name: str) -> None:
        """Forget stream ``name`` and its seed, if it exists."""
        name = _canonical(name)
        self._states.pop(name, None)
        self._seeds.pop(name, None)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL):
        """Run the block with stream ``name`` as the default generator, then put it back."""
        name = _canonical(name)
        if name not in self._states:
            raise RuntimeError(f"no random stream {name!r}: create it with "
                               "slapo.set_random_seed(seed, tp_rank=...) or add(name, seed)")
        outside = _capture()
        _restore(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _capture()
            _restore(outside)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Each stream's state, by name, of the generator it drives (Megatron-LM's form)."""
        return {name: state.get(_DEVICE, state.get("cpu")) for name, state in
                self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams by ``states`` (as ``get_states`` gives them)."""
        self._states = {_canonical(name): {_DEVICE: value} for name, value in states.items()}

    def checkpoint_contexts(self):
        """``context_fn`` for ``torch.utils.checkpoint``: the recomputation sees the streams as
        they were when the checkpointed forward started; afterwards they continue unchanged."""
        at_forward = self._snapshot()

        @contextlib.contextmanager
        def recompute():
            latest = self._snapshot()
            self._states = at_forward
            try:
                yield
            finally:
                self._states = latest

        return contextlib.nullcontext(), recompute()

    def _snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: dict(state) for name, state in self._states.items()}


# The generator whose state get_states() reports: the one dropout on the model's device uses.
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _capture() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore(state: dict[str, torch.Tensor]) -> None:
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


_STREAMS = RNGStreams()


def rng_streams() -> RNGStreams:
    """The process-wide stream registry used by ``fork_rng`` and ``checkpoint``."""
    return _STREAMS


def get_cuda_rng_tracker() -> RNGStreams:
    """The stream registry under upstream Slapo's (and Megatron-LM's) name: ``add(name,
    seed)``, ``fork(name="model-parallel-rng")``, ``get_states()``, ``set_states()``,
    ``reset()``. Despite the name it is device-agnostic: each stream holds the CPU generator's
    state and, where CUDA is in use, the current device's."""
    return _STREAMS


def set_random_seed(seed: int = 2013, dp_rank: int | None = None, pp_rank: int | None = None,
                    tp_rank: int | None = None, always_enable_tp_seed: bool = False) -> int:
    """Seed Python's, NumPy's and PyTorch's generators for this rank; returns the seed used.

    Pipeline stages and data-parallel replicas draw differently (``seed + 100 * pp_rank +
    10 * dp_rank``, upstream Slapo's rule); ranks of one tensor-parallel group share the
    default generator, and with ``tp_rank`` each also gets its per-rank stream
    (``seed + 2718 + tp_rank``) for dropout inside sharded regions (``fork_rng``);
    ``always_enable_tp_seed`` (upstream's) registers that stream without a ``tp_rank`` too,
    as rank 0's, so that a schedule's ``fork_rng`` finds it on one device.
    """
    import random

    seed += 100 * (pp_rank or 0) + 10 * (dp_rank or 0)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # slapo itself does not need NumPy
        np = None
    if np is not None:
        np.random.seed(seed % 2**32)
    if tp_rank is None and not always_enable_tp_seed:
        torch.manual_seed(seed)
    else:
        manual_seed(seed, tp_rank or 0)
    return seed


def is_random_seed_set() -> bool:
    """Whether the per-rank stream of ``set_random_seed(..., tp_rank=...)`` is registered
    (upstream Slapo's check)."""
    return bool(_STREAMS.get_states())


def manual_seed(seed: int, rank: int = 0, stream: str = TENSOR_PARALLEL) -> None:
    """Seed the default generator with ``seed`` (identical on all ranks) and the per-rank stream
    with ``seed + STREAM_SEED_OFFSET + rank``."""
    torch.manual_seed(seed)
    _STREAMS.discard(stream)  # seeding again starts the stream anew
    _STREAMS.add(stream, seed + STREAM_SEED_OFFSET + rank)


# Upstream Slapo's (and Megatron-LM's) names for the registry and its seeding.
CudaRNGStatesTracker = RNGStreams
_CUDA_RNG_STATE_TRACKER = _STREAMS


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int = 0,
                                    always_enable_tp_seed: bool = False) -> int:
    """Upstream's name for :func:`manual_seed`: the default generator from ``seed``, the
    ``"model-parallel-rng"`` stream from ``seed + 2718 + tp_rank``, which is returned.
    ``always_enable_tp_seed`` is accepted; the per-rank stream is always made."""
    manual_seed(seed, tp_rank)
    return seed + STREAM_SEED_OFFSET + tp_rank
