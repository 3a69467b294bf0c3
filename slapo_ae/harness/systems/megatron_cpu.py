"""Run megatron-core's models on CPU ranks (gloo): the small adapter they need (0.16.1).

megatron-core's tensor-parallel layers run on CPU as they are (with
``use_cpu_initialization=True``), but its model forward touches CUDA in three places:

1. the global memory buffer (``parallel_state.get_global_memory_buffer``), which the local
   ``DotProductAttention`` uses for its score matrix, allocates on
   ``torch.cuda.current_device()``: replaced by a buffer that allocates on the CPU;
2. the RNG tracker (``tensor_parallel.random``), which keeps named CUDA generator states for
   dropout inside tensor-parallel regions and for recomputation: replaced by a tracker that
   keeps CPU generator states, seeded as ``model_parallel_cuda_manual_seed`` would seed the
   CUDA ones (data parallel ``seed``, tensor parallel ``seed + 2718 + tp_rank``); the module's
   ``_get_cuda_rng_state``/``_set_cuda_rng_state`` (used by its ``CheckpointFunction`` for
   full recomputation) then read and write the CPU generator;
3. a default causal mask made on ``device="cuda"`` when no attention mask is passed: the
   harness always passes explicit masks (as Megatron-LM's data loader does);
4. ``RotaryEmbedding.get_emb`` moves its ``inv_freq`` to ``torch.cuda.current_device()`` on
   first use: wrapped so that, during that call only, the current device reads as the CPU.

``install`` is called once per process, after ``initialize_model_parallel``, on CPU only.

Pipeline parallelism (``megatron`` with pp > 1, :mod:`.megatron_3d`) touches CUDA in more
places: the schedule counts tokens in ``torch.zeros([], device="cuda")``, the p2p
communicator receives into ``torch.empty(..., device=torch.cuda.current_device())``, and a
last stage holding a copy of a tied embedding moves it with ``weight.data.cuda()`` before the
all-reduce that copies the first stage's values. :func:`cuda_as_cpu` runs a block (the model
build, each forward-backward) with CUDA read as the CPU: a ``TorchFunctionMode`` that turns a
``cuda`` device argument into ``cpu`` and ``Tensor.cuda()`` into the tensor itself, and
``torch.cuda.current_device`` answering ``"cpu"``. The p2p transfers themselves are gloo's
``isend``/``irecv`` (``batch_p2p_comm=False``: batched p2p ends in ``torch.cuda.synchronize``).
"""
from __future__ import annotations

import contextlib
import math

import torch


def _buffer_class():
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUGlobalMemoryBuffer(GlobalMemoryBuffer):
        """``GlobalMemoryBuffer`` that allocates on the CPU."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            required = math.prod(tensor_shape)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < required:
                buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
            return buf[:required].view(*tensor_shape)

    return CPUGlobalMemoryBuffer


def _tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """``CudaRNGStatesTracker`` over CPU generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    return CPURNGStatesTracker


def _patch_rotary() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    cls = rope.RotaryEmbedding
    if getattr(cls.get_emb, "_slapo_cpu", False):
        return
    inner = cls.get_emb

    def get_emb(self, *args, **kwargs):
        saved = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
        try:
            return inner(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = saved

    get_emb._slapo_cpu = True
    cls.get_emb = get_emb


def install(seed: int, tp_rank: int) -> None:
    """Swap in the CPU buffer and RNG tracker, wrap RoPE (see the module docstring)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    _patch_rotary()
    parallel_state._GLOBAL_MEMORY_BUFFER = _buffer_class()()
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    tracker = _tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


def _cuda_to_cpu_mode():
    from torch.overrides import TorchFunctionMode

    def on_cpu(device):
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            return torch.device("cpu")
        return device

    class CudaAsCPU(TorchFunctionMode):
        """``device="cuda"`` arguments become the CPU; ``Tensor.cuda()`` keeps the tensor."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.cuda:
                return args[0]
            if "device" in kwargs:
                kwargs = {**kwargs, "device": on_cpu(kwargs["device"])}
            return func(*args, **kwargs)

    return CudaAsCPU()


@contextlib.contextmanager
def cuda_as_cpu():
    """Run the block with CUDA read as the CPU (see the module docstring)."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with _cuda_to_cpu_mode():
            yield
    finally:
        torch.cuda.current_device = saved
