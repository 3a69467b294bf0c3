"""Schedules of the paper's models (and of GPT-2 and ALBERT, as upstream Slapo has them), one
module per family, behind one entry point.

    sch = slapo.create_schedule(model)         # e.g. a transformers BertForMaskedLM
    schedule_model(sch, kernel_opt=True, ckpt_ratio=0.5)
    model = slapo.build_module(sch)

The schedule is chosen from the model itself: its config's ``model_type`` (``bert``,
``roberta``, ``albert``, ``gpt2``, ``gpt_neo``, ``opt``, ``t5``, ``llama``, ``wideresnet``)
names the module of its family here (``<model_type>.py``, each a ``schedule(sch, opts)``);
shared building blocks live in ``common.py`` and kernels in ``slapo.op``. ``apply_schedule(
model, model_config, **sch_config)`` (``api.py``) is upstream Slapo's entry point to the same
schedules: it creates the schedule, applies the family's and returns the schedule.

Options (each family honours all of them):
  tensor_parallel  shard attention heads and the FFN over ``sch``'s group (Megatron style:
                   column-parallel QKV / first FFN projection, row-parallel output projections;
                   WideResNet: ``conv1`` by output and ``conv2`` by input channels), with
                   ``fork_rng`` on the sharded regions that hold dropout (attention
                   probabilities; T5's FFN), so their dropout masks differ across ranks while
                   dropout on replicated activations stays identical. No-op on one rank.
  shard_embedding  with tensor_parallel, shard the word embedding by vocabulary as well, and the
                   LM head with it (tied or not); the loss is then the vocabulary-parallel cross
                   entropy (``slapo.op.vocab_parallel_cross_entropy``) on sharded logits: the
                   output's ``.loss`` is the full loss, its ``.logits`` this rank's vocabulary
                   slice. A vocabulary the ranks do not divide is padded first
                   (``shard(pad=True)``), and the loss leaves the padded words out.
                   WideResNet has no embedding.
  kernel_opt       attention through ``scaled_dot_product_attention`` (``slapo.op``; GPT-Neo's
                   attention core is replaced, the others use transformers' attention
                   interface), dropout whose mask is drawn the way that is fast on the device
                   (``slapo.op.Dropout``: uniform draws on CPU, ``F.dropout`` on CUDA), fused
                   bias+GeLU where the model has one (BERT and RoBERTa intermediate: found in
                   the traced block and fused, compiled with ``slapo.op.kernel_compiler()``:
                   Inductor on CUDA, uncompiled on CPU; not at all on CUDA when nothing may
                   compile it, ``SLAPO_COMPILE_KERNELS=0``, as the Linear's bias is then best
                   left in cuBLAS's epilogue; GPT-Neo MLP: its written-out tanh GeLU
                   found and replaced by ``slapo.op.bias_gelu``, one GeLU op that is faster
                   than the uncompiled formula on CPU;
                   GPT-2 ``mlp.c_fc``, a Conv1D: ``slapo.op.Conv1DGeLU``); OPT, T5 and LLaMA
                   have no GeLU after a biased linear, WideResNet nothing to replace, and
                   ALBERT's is fused only in its compiled layers (upstream's ALBERT schedule
                   left it unfused by default); and the
                   LM head of a vocabulary that is no multiple of 8 words (BERT, RoBERTa,
                   GPT-Neo, GPT-2) multiplies on rows padded to a multiple of 128 on CUDA
                   (``slapo.op.PaddedLinear``: cuBLAS's fast kernels need aligned rows). (GPT-2
                   with tensor_parallel computes its attention through SDPA in any case, see
                   ``gpt2.py``.)
  ckpt_ratio       checkpoint the first ``round(ratio * layers)`` layers (Python's round; T5
                   counts encoder then decoder blocks, WideResNet its bottleneck blocks,
                   ALBERT the calls of its shared layers).
  device           the device type the model trains on, ``"cpu"`` or ``"cuda"`` (default: CUDA
                   when a GPU is visible): kernel_opt chooses what is fastest there.
  compile_layers   with kernel_opt, compile each transformer layer (T5: block) as one
                   ``torch.compile`` region (the ``compile`` primitive), in which
                   Inductor fuses the memory-bound work between the matrix products (norms with
                   their residual add and dropout, rotary embeddings, gated activations,
                   bias+activation) and cuBLAS keeps each Linear's bias in its epilogue; the
                   bias+GeLU rewrites above are then left out. The loss is compiled too
                   (``slapo.op.compiled_loss``: the float32 cross entropy in one region, where
                   the model's eager loss writes out vocabulary-sized tensors), unless the
                   vocabulary-parallel loss replaces it, and BERT's MLM head transform (dense,
                   GeLU, LayerNorm) is one more region. WideResNet compiles nothing.
                   The regions are compiled for static shapes (``dynamic=False``): training
                   runs fixed shapes, and the attention's kernel is measured for one shape
                   (``slapo.op.sdpa_backend``; a dynamic size cannot be measured for, and
                   T5's blocks, whose code serves the encoder's length and the decoder's, went
                   dynamic).
                   Default: on CUDA, where the same fusion over the whole model
                   (``hf-compile``) trained bert-large and llama-1.1b 1.23x and 1.29x as fast
                   as HF with SDPA on one H200; off on CPU, where compiling costs seconds
                   per layer and the rewrites above were measured faster. Under DeepSpeed
                   ZeRO-3, which gathers parameters in module hooks, ``build(target=
                   "deepspeed")`` makes each compiled layer a ZeRO-3 leaf module
                   (``slapo.engines.with_zero3_leaves``) and keeps torch's own linear in
                   them (``slapo.engines.with_torch_linear``; with torch 2.11, DeepSpeed's
                   left compiled Linear layers with a bias without gradients).
The scheduled model is called exactly like the plain one and returns its loss the same way.

Each family's ``schedule`` calls the primitives itself, in the order of the paper's listings:
kernels first (``slapo.op``'s attention and dropout; bias+GeLU through the static-graph path:
``trace`` the FFN, ``decompose`` its first linear, ``find`` the bias add and GeLU, ``fuse``
them, or for GPT-Neo ``replace`` them by one GeLU op), then tensor parallelism (``shard``,
``sync``, ``fork_rng``), then ``checkpoint``.

Lines of schedule code (Table 4): the artifact counts a family module's function bodies and
those of every project helper it calls (``checkpoint_layers`` here, ``common.py``), by the
artifact's rule (``slapo_ae.analysis.loc``); library code (``slapo.op``, the primitives) is
not counted, as upstream Slapo's library was not.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ScheduleOptions:
    tensor_parallel: bool = True
    shard_embedding: bool = True
    kernel_opt: bool = True
    ckpt_ratio: float = 0.0
    device: str | None = None  # the device type the kernels are chosen for
    compile_layers: bool | None = None  # one torch.compile region per layer

    def __post_init__(self):
        if not 0.0 <= self.ckpt_ratio <= 1.0:
            raise ValueError(f"ckpt_ratio must lie in [0, 1], got {self.ckpt_ratio}")
        if self.device is None:
            import torch

            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.compile_layers is None:
            object.__setattr__(self, "compile_layers",
                               self.kernel_opt and self.device == "cuda")


def checkpoint_layers(layers: list, ratio: float) -> int:
    """Checkpoint the first ``round(ratio * len(layers))`` of the schedule nodes ``layers``;
    returns how many."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ckpt_ratio must lie in [0, 1], got {ratio}")
    count = round(ratio * len(layers))
    for layer in layers[:count]:
        layer.checkpoint()
    return count


FAMILIES = ("bert", "roberta", "albert", "gpt2", "gpt_neo", "opt", "t5", "llama", "wideresnet")


def model_type(model) -> str | None:
    """The model's type: ``config.model_type`` of a transformers model (or of any module with
    such a config, WideResNet's included), else None."""
    return getattr(getattr(model, "config", None), "model_type", None)


def schedule_model(sch, family: str | None = None, **options) -> ScheduleOptions:
    """Apply the schedule of the model under the root schedule ``sch``, chosen from the model
    (:func:`model_type`) unless ``family`` names one; returns the options used."""
    import importlib

    family = family or model_type(sch.mod)
    opts = ScheduleOptions(**options)
    if family not in FAMILIES:
        raise NotImplementedError(
            f"no schedule for {type(sch.mod).__name__} (model type {family!r}); scheduled "
            f"model types: {', '.join(FAMILIES)}")
    importlib.import_module(f".{family}", __name__).schedule(sch, opts)
    return opts


from .api import apply_schedule  # noqa: E402  (it builds on the definitions above)

__all__ = ["FAMILIES", "ScheduleOptions", "apply_schedule", "checkpoint_layers", "model_type",
           "schedule_model"]
