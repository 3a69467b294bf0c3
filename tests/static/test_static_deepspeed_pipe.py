"""Upstream Slapo's pipeline on DeepSpeed's engine (``build(sch, target="deepspeed",
topology=..., config=..., loss_fn=...)`` for a schedule with cuts; ``engine.train_batch``) on
4 gloo CPU ranks, one spawn for every check:

- pipeline 2 x tensor 2 of a tiny GPT-Neo (dropout off), tensor-parallel by its family
  schedule over the topology's tensor groups, traced whole and cut after its first layer:
  its stages pass ints (carried as tensors) and its LM head is tied to its word embedding
  (both stages hold the weight; DeepSpeed's engine sums their gradients); and of a tiny
  LLaMA, whose stages pass the rotary embeddings (floats that need no gradient);
- data 2 x pipeline 2 of the GPT-Neo, given DeepSpeed's own
  ``PipeModelDataParallelTopology``;
- data 2 x pipeline 2 of the LLaMA traced with its labels and built with ``loss_fn=None``
  (upstream's call): the model's own loss;
- data 2 x pipeline 2 of the GPT-Neo made on the meta device and initialised by ``build``
  (upstream's way): a stage's replicas start alike, the tied LM head as the embedding;
- in each of the first four, once the schedule is dropped, a rank keeps its own stage's
  layers and not the other stage's (weak references to a weight of each layer);
- pipeline 2 x tensor 2 of the LLaMA with each layer one compiled region (the schedule's
  CUDA path, Slapo-3D's on a GPU; Inductor on CPU): the plain model's losses within 1e-4;
- upstream's 3D example as it calls the library (``apply_schedule`` with ``pipeline_cuts``,
  ``bcast_input``, uniform checkpointing; ``ParallelCrossEntropy``; micro-batches of
  ``[input_ids, attention_mask, position_ids], labels``), from the plain model's weights
  (its losses) and from the meta device (one step); and ``bcast_input`` without a pipeline;
- upstream's pipelines of BERT and RoBERTa through ``apply_schedule``'s ``pipeline_cuts``
  (``[input_ids, attention_mask]``, BERT's with ``token_type_ids``), pipeline 2 x tensor 2,
  the MLM decoder tied to the word embedding across the stages, a vocabulary-parallel loss;
  of OPT
  (``[input_ids, attention_mask]``) and GPT-2 (with ``position_ids``), their LM heads tied
  likewise; and of
  WideResNet (a list of block cuts for each of its four layers), its convolutions and batch
  norms sharded (also as upstream's example calls it: under a wrapper adding the loss, at
  ``prefix``, its input ``x``); and of T5 (a list of cuts for the encoder's blocks and one
  for the decoder's, and a stage boundary after the encoder): the encoder's output and the
  shared embedding reach the decoder's stage; and of a T5 made on the meta device;
- data 2 x pipeline 2 under torch's autocast in bf16: around ``train_batch`` (DeepSpeed turns it
  off in its forward) and in DeepSpeed's ``torch_autocast`` section (it computes in bf16);
- misuse (no topology, no config, stages the topology does not have): an error saying what
  to pass, before DeepSpeed starts; a last stage that gives no loss without ``loss_fn``: an
  error saying so.

Each trains 3 SGD steps (the optimizer given to ``build`` as a function of the parameters,
which DeepSpeed calls), 2 micro-batches a step per replica, and must give the plain model's
losses under the same SGD on the whole batch, within a relative 1e-5 at each step: a gradient
off anywhere (a tie not summed, a shard not reduced) changes the next step's loss.
"""

import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from static_models import Chain

import slapo
from slapo.model_schedule import schedule_model
from slapo_ae.zoo import build_model, no_dropout, synthetic_batch

pytestmark = pytest.mark.slow

TOL = 1e-5
STEPS, BATCH, MICRO, SEQ = 3, 4, 2, 20
LR = 0.1
CLIP = 1.0  # below the gradients' norm (about 3): every step is clipped
CUTS = {"llama-tiny": "model.layers.0", "gpt-neo-tiny": "transformer.h.0"}
LAYERS = {"llama-tiny": lambda model: model.model.layers,
          "gpt-neo-tiny": lambda model: model.transformer.h}


def _gpt2_config():
    """A tiny GPT-2 (upstream's family; the zoo has no GPT-2 model), dropout off."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=128, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0)


def _model(name):
    torch.manual_seed(0)
    if name == "gpt2-tiny":
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(_gpt2_config())
    return build_model(name, **no_dropout(name))


def _batch(name, step):
    if name == "gpt2-tiny":
        gen = torch.Generator().manual_seed(10 + step)
        ids = torch.randint(0, _gpt2_config().vocab_size, (BATCH, SEQ), generator=gen)
        return ids, torch.ones_like(ids), ids
    batch = synthetic_batch(name, BATCH, SEQ, seed=10 + step)
    return batch["input_ids"], batch["attention_mask"], batch["labels"]


def causal_loss(output, labels):
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1))


def _train(name, dp, pp, tp, deepspeed_topology=False, model_loss=False, **options):
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    topo = slapo.Topology(dp=dp, pp=pp, tp=tp)
    sch = slapo.create_schedule(_model(name), group=topo.tensor_group)
    schedule_model(sch, tensor_parallel=True, shard_embedding=False, **options)
    # a weight of each layer, as the schedule left it (tracing keeps the parameters)
    layers = [weakref.ref(next(layer.parameters())) for layer in LAYERS[name](sch.mod)]
    ids, mask, labels = _batch(name, 99)
    inputs = {"input_ids": ids[:2], "attention_mask": mask[:2]}
    if model_loss:  # traced with its labels, the model computes its loss
        inputs["labels"] = labels[:2]
    sch.trace(example_inputs=inputs, concrete_args={"use_cache": False, "return_dict": False})
    sch[CUTS[name]].cut_pipeline_stage()
    if deepspeed_topology:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    else:
        topology = topo
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO // dp,
              "gradient_accumulation_steps": BATCH // MICRO, "gradient_clipping": CLIP,
              "steps_per_print": 10 ** 6}
    engine, _ = slapo.build(sch, target="deepspeed", topology=topology, config=config,
                            loss_fn=None if model_loss else causal_loss, init_weights=False,
                            optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    del sch
    gc.collect()
    gc.collect()  # the trace leaves cycles that a second pass frees (measured: LLaMA's)
    held = [layer() is not None for layer in layers]  # what the engine keeps of the model
    share = MICRO // dp
    losses = []
    for step in range(STEPS):
        ids, mask, labels = _batch(name, step)
        micro = []
        for start in range(0, BATCH, MICRO):  # this replica's rows of each micro-batch
            rows = slice(start + topo.data_rank * share, start + (topo.data_rank + 1) * share)
            inputs = (ids[rows], mask[rows], labels[rows]) if model_loss else \
                (ids[rows], mask[rows])
            micro.append((inputs, labels[rows]))
        losses.append(engine.train_batch(data_iter=iter(micro)).item())
    return {"losses": losses, "held": held, "stage": topo.stage_index,
            "compiled_graphs": counters["stats"]["unique_graphs"] - graphs_before}


def _from_meta(name="gpt-neo-tiny"):
    """Upstream's way: the model made on the meta device, ``build`` with ``init_weights``
    (drawn from a different seed on every rank)."""
    topo = slapo.Topology(dp=2, pp=2, tp=1)
    torch.manual_seed(100 + topo.rank)
    with slapo.init_empty_weights():
        model = build_model(name, **no_dropout(name))
    sch = slapo.create_schedule(model, group=topo.tensor_group)
    schedule_model(sch, tensor_parallel=True, shard_embedding=False)
    ids, mask, labels = _batch(name, 99)
    sch.trace(example_inputs={"input_ids": ids[:2], "attention_mask": mask[:2]},
              concrete_args={"use_cache": False, "return_dict": False})
    sch[CUTS[name]].cut_pipeline_stage()
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": 1,
              "steps_per_print": 10 ** 6}
    engine, _ = slapo.build(sch, target="deepspeed", topology=topo, config=config,
                            loss_fn=causal_loss, init_weights=model._init_weights,
                            optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    weights = {n.split(".", 2)[2]: p.detach().clone() for n, p in engine.module.named_parameters()}
    rows = slice(topo.data_rank * 2, topo.data_rank * 2 + 2)
    micro = [((ids[rows][i:i + 1], mask[rows][i:i + 1]), labels[rows][i:i + 1]) for i in range(2)]
    loss = engine.train_batch(data_iter=iter(micro)).item()
    return topo.stage_index, weights, loss


def _upstream_3d(meta=False):
    """Upstream's 3D example (examples/gpt_neo/deepspeed_hf.py) as it calls the library:
    ``apply_schedule`` with its keys (``schedule_key``, ``pipeline_cuts``, ``bcast_input``,
    ``delay_init``, uniform checkpointing), its vocabulary-parallel loss
    (``ParallelCrossEntropy``) and micro-batches of ``[input_ids, attention_mask,
    position_ids], labels``; here from the plain model's weights, with SGD and the clipping
    of the other cases, or (``meta``) as upstream ran it: the model made on the meta device,
    initialised by ``build``, one step."""
    from slapo.model_schedule import apply_schedule
    from slapo.op import ParallelCrossEntropy

    topo = slapo.Topology(dp=1, pp=2, tp=2)
    with slapo.init_empty_weights(enable=meta):
        model = _model("gpt-neo-tiny")
    config = model.config
    sch = apply_schedule(model, schedule_key="gpt_neo", model_config=config,
                         prefix="transformer", attn_op_name="cuda", ckpt_ratio=0.5,
                         checkpoint_method="uniform", bcast_input=True, fp16=False, bf16=False,
                         group=topo.tensor_group, pipeline_cuts=[0], delay_init=True,
                         sequence_parallel=False)
    parallel_loss = ParallelCrossEntropy(group=topo.tensor_group)

    def loss_fn(outputs, labels):  # upstream's
        return parallel_loss(outputs[..., :-1, :].contiguous(),
                             labels[..., 1:].contiguous()).contiguous().mean()

    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": BATCH // MICRO, "gradient_clipping": CLIP,
              "steps_per_print": 10 ** 6}
    engine, _ = slapo.build(sch, topology=topo, target="deepspeed", config=config,
                            loss_fn=loss_fn, init_weights=model._init_weights if meta else False,
                            optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    checkpointed = sorted(name for name, m in engine.module.named_modules()
                          if type(m).__name__ == "CheckPointWrapper")
    losses = []
    for step in range(1 if meta else STEPS):
        ids, mask, labels = _batch("gpt-neo-tiny", step)
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        micro = [([ids[k:k + MICRO], mask[k:k + MICRO].float(), positions[k:k + MICRO]],
                  labels[k:k + MICRO]) for k in range(0, BATCH, MICRO)]
        losses.append(engine.train_batch(data_iter=iter(micro)).item())
    return {"losses": losses, "checkpointed": checkpointed, "stage": topo.stage_index}


def mlm_loss(output, labels):
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _upstream_encoder_pipeline(name):
    """Upstream's pipeline of BERT and RoBERTa (its model schedules'
    ``generate_pipeline_schedule``: the encoder's layers cut; the inputs as its examples feed
    them, ``input_ids``, ``attention_mask`` and, for BERT, ``token_type_ids``), through
    ``apply_schedule`` with tensor parallelism and a vocabulary-parallel loss, pipeline 2 x
    tensor 2, from the plain model's weights; the MLM head's decoder is tied to the word
    embedding across the stages."""
    from slapo.model_schedule import apply_schedule
    from slapo.op import ParallelCrossEntropy

    topo = slapo.Topology(dp=1, pp=2, tp=2)
    model = _model(name)
    sch = apply_schedule(model, model.config, group=topo.tensor_group, pipeline_cuts=[0],
                         bcast_input=True, ckpt_ratio=0.5, checkpoint_method="uniform")
    parallel_loss = ParallelCrossEntropy(group=topo.tensor_group)

    def batch(step):
        ids, mask, labels = _batch(name, step)
        if name == "roberta-tiny":
            return (ids, mask), labels
        return (ids, mask, torch.zeros_like(ids)), labels

    return _train_on_engine(sch, topo, lambda out, labels: parallel_loss(out, labels).mean(),
                            batch)


def _upstream_decoder_pipeline(name):
    """Upstream's pipelines of OPT and GPT-2 through ``apply_schedule``'s ``pipeline_cuts``
    (as its examples feed them: ``[input_ids, attention_mask]`` for OPT, with
    ``position_ids`` for GPT-2), pipeline 2 x tensor 2 with ``bcast_input``, the LM head tied
    to the word embedding across the stages and sharded by vocabulary with it, upstream's
    vocabulary-parallel loss."""
    from slapo.model_schedule import apply_schedule
    from slapo.op import ParallelCrossEntropy

    topo = slapo.Topology(dp=1, pp=2, tp=2)
    model = _model(name)
    sch = apply_schedule(model, model.config, group=topo.tensor_group, pipeline_cuts=[0],
                         bcast_input=True)
    parallel_loss = ParallelCrossEntropy(group=topo.tensor_group)

    def loss_fn(outputs, labels):  # upstream's 3D example's
        return parallel_loss(outputs[..., :-1, :].contiguous(),
                             labels[..., 1:].contiguous()).contiguous().mean()

    def batch(step):
        ids, mask, labels = _batch(name, step)
        if name == "opt-tiny":
            return (ids, mask), labels
        return (ids, mask, torch.arange(SEQ).expand(BATCH, SEQ)), labels

    return _train_on_engine(sch, topo, loss_fn, batch)


def _train_on_engine(sch, topo, loss_fn, batch, steps=STEPS, init_weights=False):
    """``steps`` SGD steps of the schedule on DeepSpeed's engine (clipped, ``BATCH // MICRO``
    micro-batches a step), built with ``init_weights``; ``batch(step)`` gives the step's
    inputs (a tuple, in the traced order) and labels. Returns the engine's losses."""
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": BATCH // MICRO, "gradient_clipping": CLIP,
              "steps_per_print": 10 ** 6}
    engine, _ = slapo.build(sch, topology=topo, target="deepspeed", config=config,
                            loss_fn=loss_fn, init_weights=init_weights,
                            optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    losses = []
    for step in range(steps):
        inputs, labels = batch(step)
        micro = [([x[k:k + MICRO] for x in inputs], labels[k:k + MICRO])
                 for k in range(0, BATCH, MICRO)]
        losses.append(engine.train_batch(data_iter=iter(micro)).item())
    return {"losses": losses}


class WithLoss(torch.nn.Module):
    """Upstream's WideResNet example's wrapper (``ResNetWithLoss``): the model at ``model``,
    called with ``x``, the loss added when labels are given."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, labels=None):
        logits = self.model(x).logits
        return logits if labels is None else image_loss(logits, labels)


def _upstream_wideresnet_pipeline(wrapped=False):
    """Upstream's WideResNet pipeline (a list of block cuts for each of layer1 .. layer4)
    through ``apply_schedule`` with tensor parallelism (its convolutions and batch norms
    sharded), pipeline 2 x tensor 2, from the plain model's weights; ``wrapped``: as its
    example calls it, the model under ``WithLoss`` at ``prefix="model"``, given by name with
    upstream's config dict."""
    from slapo.model_schedule import apply_schedule

    topo = slapo.Topology(dp=1, pp=2, tp=2)
    model = _model("wideresnet-tiny")
    if wrapped:
        sch = apply_schedule(WithLoss(model), "wideresnet", group=topo.tensor_group,
                             model_config={"block_size": (128, [1, 1, 1, 1])},
                             prefix="model", pipeline_cuts=[[], [0], [], []], fuse_conv=False)
    else:
        sch = apply_schedule(model, model.config, group=topo.tensor_group,
                             pipeline_cuts=[[], [0], [], []])

    def batch(step):
        images, labels = _images(step)
        return (images,), labels

    return _train_on_engine(sch, topo, image_loss, batch)


def _t5_batch(step):
    batch = synthetic_batch("t5-tiny", BATCH, SEQ, 8, seed=10 + step)
    decoder_ids = batch["labels"].roll(1, dims=1)  # teacher forcing, as T5 shifts its labels
    return (batch["input_ids"], batch["attention_mask"], decoder_ids,
            torch.ones_like(decoder_ids)), batch["labels"]


def _upstream_t5_pipeline(pp, meta=False):
    """Upstream's T5 pipeline (``pipeline_cuts`` a list for the encoder's blocks and one for
    the decoder's, and a stage boundary after the encoder) through ``apply_schedule``, from
    the plain model's weights: pipeline 2 x tensor 2 (the encoder one stage, the decoder the
    other), or 4 stages (a cut after the first block of each as well). The decoder's stages get
    the encoder's output (a ModelOutput: its fields cross), and the embedding it shares with
    the encoder. ``meta``: the model made on the meta device, as upstream's T5 example makes
    it, and initialised by ``build``; one step."""
    from slapo.model_schedule import apply_schedule
    from slapo.op import ParallelCrossEntropy

    topo = slapo.Topology(dp=1, pp=pp, tp=4 // pp)
    with slapo.init_empty_weights(enable=meta):
        model = _model("t5-tiny")
    cuts = [[], []] if pp == 2 else [[0], [0]]
    sch = apply_schedule(model, model.config, group=topo.tensor_group, pipeline_cuts=cuts)
    parallel_loss = ParallelCrossEntropy(group=topo.tensor_group)
    # the last stage gives (logits, the encoder's last hidden state)
    return _train_on_engine(sch, topo, lambda out, labels: parallel_loss(out[0], labels).mean(),
                            _t5_batch, steps=1 if meta else STEPS,
                            init_weights=model._init_weights if meta else False)


def _images(step):
    # 64 x 64 rather than the tiny model's 32 x 32: at 32, layer4's batch norm normalizes 2
    # values a channel (a micro-batch of 2 at 1 x 1), which makes the training chaotic (fp32
    # and fp64 of the plain model 1e-3 apart at step 1); at 64, 5e-7 apart after 3 steps
    batch = synthetic_batch("wideresnet-tiny", BATCH, 0, seed=10 + step)
    return F.interpolate(batch["pixel_values"], size=64), batch["labels"]


def image_loss(output, labels):
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits, labels)


def _broadcast_input():
    """``bcast_input`` without a pipeline: each tensor rank is given other ids (the second a
    view that is not contiguous), and computes on its group's first rank's."""
    from slapo.model_schedule import apply_schedule

    topo = slapo.Topology(dp=2, pp=1, tp=2)
    model = _model("gpt-neo-tiny")
    ids = _batch("gpt-neo-tiny", 0)[0]
    first = ids.roll(topo.data_rank, dims=0)  # what the group's first rank is given
    sch = apply_schedule(model, model.config, bcast_input=True, group=topo.tensor_group,
                         shard_embedding=False)  # whole logits on every rank
    given = first.clone() if topo.tensor_rank == 0 else \
        torch.randint(0, 100, tuple(reversed(ids.shape))).t()
    logits = slapo.build_module(sch).eval()(given)[0]
    return {"given": given, "first": first, "logits": logits}


def _autocast():
    """The dtype a stage's Linear computes in under DeepSpeed's engine (data 2 x pipeline 2),
    with torch's autocast (bf16, on this device) around ``train_batch`` (``outer``) or in the
    config's ``torch_autocast`` section (``config``, Slapo-3D's way), and whether any
    parameter was marked for bf16 gradient reduction. DeepSpeed asks
    ``torch.is_autocast_enabled()``, which reads CUDA's autocast: for ``outer`` it is made to
    read this device's, so that DeepSpeed does here what it does on a GPU."""
    from unittest import mock

    import deepspeed.runtime.torch_autocast as ds_autocast

    out = {}
    for way in ("outer", "config"):
        topo = slapo.Topology(dp=2, pp=2, tp=1)
        sch = slapo.create_schedule(_model("gpt-neo-tiny"), group=topo.tensor_group)
        schedule_model(sch, tensor_parallel=True, shard_embedding=False)
        ids, mask, labels = _batch("gpt-neo-tiny", 0)
        sch.trace(example_inputs={"input_ids": ids[:2], "attention_mask": mask[:2]},
                  concrete_args={"use_cache": False, "return_dict": False})
        sch[CUTS["gpt-neo-tiny"]].cut_pipeline_stage()
        config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": 1,
                  "steps_per_print": 10 ** 6}
        if way == "config":
            config["torch_autocast"] = {"enabled": True, "dtype": "bf16",
                                        "lower_precision_safe_modules": []}
        engine, _ = slapo.build(sch, target="deepspeed", topology=topo, config=config,
                                loss_fn=causal_loss, init_weights=False,
                                optimizer=lambda params: torch.optim.SGD(params, lr=LR))
        dtypes = []
        linear = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda m, i, o, seen=dtypes: seen.append(o.dtype))
        rows = slice(topo.data_rank * 2, topo.data_rank * 2 + 2)
        micro = [((ids[rows][i:i + 1], mask[rows][i:i + 1]), labels[rows][i:i + 1])
                 for i in range(2)]
        as_on_a_gpu = mock.patch.object(ds_autocast.torch, "is_autocast_enabled",
                                        lambda *args, reads=torch.is_autocast_enabled:
                                        reads("cpu"))
        with as_on_a_gpu, torch.autocast("cpu", dtype=torch.bfloat16, enabled=way == "outer"):
            engine.train_batch(data_iter=iter(micro))
        out[way] = {"dtypes": sorted(set(map(str, dtypes))),
                    "comm_dtype": any(hasattr(p, "comm_dtype") for p in engine.module.parameters())}
    return out


def _misuse():
    """The message of each misuse (every rank raises the same, before DeepSpeed starts)."""
    topo = slapo.Topology(dp=2, pp=2)
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1}

    def attempt(cuts=("a",), **kwargs):
        sch = slapo.create_schedule(Chain(), group=topo.tensor_group)
        sch.trace(example_inputs=(torch.randn(2, 4),))
        for cut in cuts:
            sch[cut].cut_pipeline_stage()
        try:
            slapo.build(sch, target="deepspeed", init_weights=False, **kwargs)
        except ValueError as err:
            return str(err)
    return {"no topology": attempt(config=config, loss_fn=F.mse_loss),
            "stages": attempt(("a", "b"), topology=topo, config=config, loss_fn=F.mse_loss),
            "no config": attempt(topology=topo, loss_fn=F.mse_loss)}


def _all():
    import os

    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # DeepSpeed reads it (torchrun sets it)
    return {"gpt_neo": _train("gpt-neo-tiny", dp=1, pp=2, tp=2),
            "llama": _train("llama-tiny", dp=1, pp=2, tp=2),
            # the CUDA path of the schedule (one compiled region a layer), Inductor on CPU
            "llama_compiled": _train("llama-tiny", dp=1, pp=2, tp=2, kernel_opt=True,
                                     device="cpu", compile_layers=True),
            "gpt_neo_dp": _train("gpt-neo-tiny", dp=2, pp=2, tp=1, deepspeed_topology=True),
            "model_loss": _train("llama-tiny", dp=2, pp=2, tp=1, model_loss=True),
            "bert": _upstream_encoder_pipeline("bert-tiny"),
            "roberta": _upstream_encoder_pipeline("roberta-tiny"),
            "opt": _upstream_decoder_pipeline("opt-tiny"),
            "gpt2": _upstream_decoder_pipeline("gpt2-tiny"),
            "wideresnet": _upstream_wideresnet_pipeline(),
            "wideresnet_wrapped": _upstream_wideresnet_pipeline(wrapped=True),
            "t5": _upstream_t5_pipeline(pp=2),
            "t5_pp4": _upstream_t5_pipeline(pp=4),
            "t5_meta": _upstream_t5_pipeline(pp=2, meta=True),
            "meta": _from_meta(), "misuse": _misuse(), "upstream_3d": _upstream_3d(),
            "upstream_3d_meta": _upstream_3d(meta=True),
            "broadcast": _broadcast_input(), "autocast": _autocast()}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_all, world_size=4)


def _plain_losses(name, loss_fn=causal_loss, batch=None):
    """The plain model's losses under the pipelines' SGD, on the whole batch of each step;
    ``batch(step)``: the model's keyword inputs and the labels (default: ``_batch``'s)."""
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        if batch is None:
            ids, mask, labels = _batch(name, step)
            inputs = {"input_ids": ids, "attention_mask": mask}
        else:
            inputs, labels = batch(step)
        loss = loss_fn(model(**inputs, return_dict=False), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("run,name", [("gpt_neo", "gpt-neo-tiny"), ("llama", "llama-tiny"),
                                      ("gpt_neo_dp", "gpt-neo-tiny"),
                                      ("model_loss", "llama-tiny")])
def test_deepspeed_pipeline_trains_like_the_plain_model(ranks, run, name):
    plain = _plain_losses(name)
    for rank, result in enumerate(ranks):
        for step, (mine, expected) in enumerate(zip(result[run]["losses"], plain)):
            err = abs(mine - expected) / abs(expected)
            assert err <= TOL, f"{run} rank {rank} step {step}: loss {mine} vs {expected}"


def test_stages_of_compiled_layers_train_like_the_plain_model(ranks):
    """Slapo-3D's path on a GPU: the stages run the layers' compiled regions (1e-4: Inductor
    reorders the float sums, as in the compile tests)."""
    plain = _plain_losses("llama-tiny")
    for rank, result in enumerate(ranks):
        got = result["llama_compiled"]
        assert got["compiled_graphs"] >= 1, rank  # the stages ran compiled regions
        for step, (mine, expected) in enumerate(zip(got["losses"], plain, strict=True)):
            assert abs(mine - expected) <= 1e-4 * abs(expected), (rank, step, mine, expected)


@pytest.mark.parametrize("run", ["gpt_neo", "llama", "gpt_neo_dp", "model_loss"])
def test_a_rank_keeps_its_own_stage_only(ranks, run):
    """Once the schedule is dropped, the engine keeps this rank's layers and no other stage's
    (DeepSpeed builds one layer of the stages here; it kept all of them, and so the whole
    model on every rank, until 2026-12-05). The models have 2 layers, one per stage."""
    for rank, result in enumerate(ranks):
        stage = result[run]["stage"]
        assert result[run]["held"] == [stage == 0, stage == 1], (rank, result[run])


def test_upstreams_3d_example_trains_like_the_plain_model(ranks):
    plain = _plain_losses("gpt-neo-tiny")
    for rank, result in enumerate(ranks):
        got = result["upstream_3d"]
        for step, (mine, expected) in enumerate(zip(got["losses"], plain, strict=True)):
            assert abs(mine - expected) <= TOL * abs(expected), (rank, step, mine, expected)
        # ckpt_ratio 0.5, uniform: every 2nd of the 2 layers, the first (in stage 0)
        assert got["checkpointed"] == (["0.stage.transformer.h.0"] if got["stage"] == 0
                                       else []), got


@pytest.mark.parametrize("run,name", [("bert", "bert-tiny"), ("roberta", "roberta-tiny")])
def test_upstreams_encoder_pipelines_train_like_the_plain_model(ranks, run, name):
    plain = _plain_losses(name, mlm_loss)
    for rank, result in enumerate(ranks):
        for step, (mine, expected) in enumerate(zip(result[run]["losses"], plain, strict=True)):
            assert abs(mine - expected) <= TOL * abs(expected), (run, rank, step, mine, expected)


@pytest.mark.parametrize("run,name", [("opt", "opt-tiny"), ("gpt2", "gpt2-tiny")])
def test_upstreams_decoder_pipelines_train_like_the_plain_model(ranks, run, name):
    plain = _plain_losses(name)
    for rank, result in enumerate(ranks):
        for step, (mine, expected) in enumerate(zip(result[run]["losses"], plain, strict=True)):
            assert abs(mine - expected) <= TOL * abs(expected), (run, rank, step, mine, expected)


@pytest.mark.parametrize("run", ["wideresnet", "wideresnet_wrapped"])
def test_upstreams_wideresnet_pipeline_trains_like_the_plain_model(ranks, run):
    # the plain model in train mode, as the stages: batch norm's statistics of each
    # micro-batch, so the plain model steps on the same micro-batches, its gradients summed
    model = _model("wideresnet-tiny")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    plain = []
    for step in range(STEPS):
        images, labels = _images(step)
        total = 0.0
        for k in range(0, BATCH, MICRO):
            loss = image_loss(model(images[k:k + MICRO]).logits, labels[k:k + MICRO])
            (loss * MICRO / BATCH).backward()
            total += loss.item() * MICRO / BATCH
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        plain.append(total)
    for rank, result in enumerate(ranks):
        for step, (mine, expected) in enumerate(zip(result[run]["losses"], plain,
                                                    strict=True)):
            assert abs(mine - expected) <= TOL * abs(expected), (rank, step, mine, expected)


@pytest.mark.parametrize("run", ["t5", "t5_pp4"])
def test_upstreams_t5_pipeline_trains_like_the_plain_model(ranks, run):
    def batch(step):
        inputs, labels = _t5_batch(step)
        names = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
        return dict(zip(names, inputs)), labels

    plain = _plain_losses("t5-tiny", mlm_loss, batch)
    for rank, result in enumerate(ranks):
        for step, (mine, expected) in enumerate(zip(result[run]["losses"], plain, strict=True)):
            assert abs(mine - expected) <= TOL * abs(expected), (run, rank, step, mine, expected)


def test_upstreams_3d_example_from_the_meta_device_trains(ranks):
    """On the meta device the layers' syncs cannot run while the root is traced, so a
    layer's output kind is unknown; the item of it that crosses the cut is taken out in the
    first stage (the whole tuple crossed, and DeepSpeed's stage failed on it, until
    2026-12-05)."""
    losses = [result["upstream_3d_meta"]["losses"] for result in ranks]
    assert all(len(x) == 1 and math.isfinite(x[0]) for x in losses)
    assert len({x[0] for x in losses}) == 1  # the engine's loss, on every rank


def test_upstreams_t5_pipeline_from_the_meta_device_trains(ranks):
    """T5 made on the meta device with tensor parallelism, as upstream's T5 example: tracing
    the root learns the encoder's output fields (its row-parallel projections' autocast
    check failed on the meta device, so the whole ModelOutput crossed the cut and DeepSpeed's
    stage could not send it, until 2026-12-06)."""
    losses = [result["t5_meta"]["losses"] for result in ranks]
    assert all(len(x) == 1 and math.isfinite(x[0]) for x in losses)
    assert len({x[0] for x in losses}) == 1  # the engine's loss, on every rank


def test_bcast_input_computes_on_the_groups_first_rank_input(ranks):
    """Tensor ranks 0/1 and 2/3 make two groups; rank 1 and 3 were given other ids."""
    plain = _model("gpt-neo-tiny").eval()
    for rank, result in enumerate(ranks):
        got = result["broadcast"]
        if got["given"].is_contiguous():  # received in place, as upstream's hook did
            assert torch.equal(got["given"], got["first"]), rank
        expected = plain(got["first"]).logits
        torch.testing.assert_close(got["logits"], expected, rtol=1e-5, atol=1e-5)


def test_deepspeed_computes_in_bf16_under_its_own_autocast_only(ranks):
    """Around its forward DeepSpeed turns off an autocast it finds on, unless its config's
    torch_autocast section is on (so Slapo-3D's bf16 case sets that section); with no
    lower-precision-safe modules, no gradient is marked for a bf16 reduction."""
    for result in ranks:
        got = result["autocast"]
        assert got["outer"]["dtypes"] == ["torch.float32"], got
        assert got["config"]["dtypes"] == ["torch.bfloat16"], got
        assert not got["config"]["comm_dtype"]


def test_misuse_is_a_clear_error(ranks):
    for result in ranks:
        errors = result["misuse"]
        assert errors["no topology"].startswith("build(target='deepspeed') of a schedule with "
                                                "pipeline cuts needs topology=")
        assert errors["stages"] == "3 pipeline stages (2 cuts) for a topology with pp=2"
        assert errors["no config"].startswith("build(target='deepspeed') needs config=")


def test_without_loss_fn_the_last_stage_must_give_the_models_loss():
    from slapo.pipeline.deepspeed_pipe import model_loss

    loss = torch.tensor(2.5)
    assert model_loss((loss, torch.ones(2, 3)), None) is loss
    with pytest.raises(ValueError, match=r"the last pipeline stage gives no loss \(its output "
                                         r"has shape \(2, 3\)\): pass build\(..., loss_fn="):
        model_loss(torch.ones(2, 3), None)


def test_a_meta_model_gets_storage_and_the_same_weights_on_a_stages_replicas(ranks):
    """Each rank draws from its own seed; a stage starts alike on its ranks (``build``
    broadcasts over them, and DeepSpeed's engine over the replicas), and the LM head starts
    as the word embedding, which it is tied to in the other stage (``build`` broadcasts it
    from the first stage: without that it differs)."""
    stages = [result["meta"] for result in ranks]
    assert [stage for stage, _, _ in stages] == [0, 0, 1, 1]
    for first, second in ((stages[0], stages[1]), (stages[2], stages[3])):
        assert first[1].keys() == second[1].keys()
        assert all(torch.equal(first[1][n], second[1][n]) for n in first[1])
    embedding = stages[0][1]["transformer.wte.weight"]
    head = [w for n, w in stages[2][1].items() if w.shape == embedding.shape]
    assert len(head) == 1 and torch.equal(head[0], embedding)
    assert not embedding.is_meta and embedding.abs().sum() > 0
    losses = {loss for _, _, loss in stages}
    assert len(losses) == 1 and all(math.isfinite(x) for x in losses)
