"""The whole model in bf16 with fp32 master copies (slapo_ae/harness/systems/master_weights.py),
and the harness's Slapo systems that train so: checked on CPU, where bf16 runs too.

Tolerance: this is not autocast's arithmetic (the residual stream is rounded to bf16 at each
layer), so the losses are compared with autocast over fp32 parameters, as the GPU check's L
target compares Slapo's with hf-sdpa's: every step's loss within LOSS_TOLERANCE of it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from slapo_ae.case import Case
from slapo_ae.harness.runspec import RunSpec
from slapo_ae.harness.systems.base import DistContext, NativeTrainer
from slapo_ae.harness.systems.master_weights import MasterWeights
from slapo_ae.zoo import build_model, synthetic_batch

BF16 = torch.bfloat16
LOSS_TOLERANCE = 0.0025  # relative; measured: 0.064% t5-tiny, the rest 0.004%; GPU check's L: 1%


def _train(model, batches, master_weights: bool):
    """Losses of training ``model`` on ``batches`` with AdamW: the whole model in bf16 with
    masters and no autocast, or CPU bf16 autocast over fp32 parameters; the loss from the
    logits in float32, as Slapo's losses compute it."""
    weights = MasterWeights(model, BF16) if master_weights else None
    params = weights.optimizer_params if weights else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    losses = []
    for batch in batches:
        batch = dict(batch)
        labels = batch.pop("labels")
        with torch.autocast("cpu", dtype=BF16, enabled=not master_weights):
            logits = model(**batch).logits
        loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())
        loss.backward()
        if weights:
            weights.step(optimizer)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, weights


def test_the_whole_model_trains_in_bf16_with_fp32_masters():
    """BERT (dropout on, its decoder tied to the word embeddings), 3 steps: every parameter is
    bf16, the rounding of its fp32 master; one master for the tied weight; buffers as they
    were; the losses within LOSS_TOLERANCE of autocast over fp32 parameters."""
    batches = [synthetic_batch("bert-tiny", 4, 16, seed=s) for s in range(3)]
    torch.manual_seed(0)
    reference, _ = _train(build_model("bert-tiny", seed=0), batches, master_weights=False)
    torch.manual_seed(0)
    model = build_model("bert-tiny", seed=0)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.dtype for name, b in model.named_buffers()}
    losses, weights = _train(model, batches, master_weights=True)

    assert losses == pytest.approx(reference, rel=LOSS_TOLERANCE)
    params = dict(model.named_parameters())
    assert weights.names == list(params) and len(weights.masters) == len(params)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    for name, master in zip(weights.names, weights.masters):
        assert params[name].dtype == BF16 and master.dtype == torch.float32
        assert torch.equal(params[name], master.to(BF16)), name
        assert not torch.equal(master, initial[name]), f"{name} was not stepped"
    assert {name: b.dtype for name, b in model.named_buffers()} == buffers
    assert weights.optimizer_params == weights.masters


def test_an_fp32_master_takes_over_the_parameters_storage():
    """No copy of the fp32 values is made: the parameter's storage becomes the master's."""
    layer = torch.nn.Linear(4, 3)
    storage = layer.weight.data_ptr()
    weights = MasterWeights(layer, BF16)
    assert weights.masters[0].data_ptr() == storage and layer.weight.data_ptr() != storage
    assert weights.describe().startswith("bfloat16 parameters (2 tensors) with fp32 master")


def _spec(model="bert-tiny", mode="slapo-megatron", dtype="bf16", dec_seq_len=0,
          no_dropout=False):
    case = Case(mode=mode, model=model, gpus=1, seq_len=16, dec_seq_len=dec_seq_len,
                batch_size=4, batch_expr="4", ckpt=0.0, steps=3, warmup=1, device="cpu",
                dtype=dtype, no_dropout=no_dropout)
    return RunSpec(case=case, out="r.json")


def test_slapo_systems_train_in_bf16_where_the_loss_is_float32_without_data_parallelism():
    from slapo import state
    from slapo_ae.harness.systems.slapo_tp import slapo_master_weights

    with_loss, without = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    state.set_loss_fn(with_loss, F.cross_entropy)

    def system(dtype=BF16, dp_size=1, model=with_loss):
        return SimpleNamespace(autocast_dtype=dtype, dp_size=dp_size, model=model)

    assert slapo_master_weights(system())
    assert not slapo_master_weights(system(dtype=torch.float16))  # loss scaling's own path
    assert not slapo_master_weights(system(dtype=None))  # fp32
    assert not slapo_master_weights(system(dp_size=2))  # DDP would reduce in bf16
    assert not slapo_master_weights(system(model=without))  # its loss would be in bf16


@pytest.fixture
def slapo_bf16_on_cpu(monkeypatch):
    """The harness's Slapo systems in bf16 on CPU (16-bit is refused there), scheduled with
    the CUDA choices: compiled layers and loss, Inductor on CPU."""
    import functools

    from slapo_ae.harness.systems import slapo_tp

    def bf16_on_cpu(self):
        self.autocast_dtype, self.scaler = BF16, None

    monkeypatch.setattr(NativeTrainer, "set_precision", bf16_on_cpu)
    monkeypatch.setattr(slapo_tp, "scheduled_model", functools.partial(
        slapo_tp.scheduled_model, trains_on=torch.device("cuda")))


@pytest.mark.slow
@pytest.mark.parametrize("model, dec_seq_len", [
    ("bert-tiny", 0), ("llama-tiny", 0), ("gpt-neo-tiny", 0), ("opt-tiny", 0), ("t5-tiny", 8)])
def test_slapo_tp_trains_in_bf16_as_with_autocast(slapo_bf16_on_cpu, monkeypatch, model,
                                                  dec_seq_len):
    """The harness's Slapo-TP with its schedule's CUDA choices (compiled layers and loss:
    Inductor on CPU), bf16 made to run on CPU: the whole model in bf16 gives every step's loss
    within LOSS_TOLERANCE of autocast over fp32 parameters; the record says which."""
    from slapo_ae.harness.systems import slapo_tp
    from slapo_ae.harness.worker import model_fields, step_batch

    spec = _spec(model, dec_seq_len=dec_seq_len)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    runs = {}
    for master in (True, False):
        if not master:
            monkeypatch.setattr(slapo_tp.SlapoTPSystem, "uses_master_weights",
                                lambda self: False)
        system = slapo_tp.SlapoTPSystem(spec, ctx)
        system.setup()
        fields = model_fields(spec)
        runs[master] = ([system.train_step(step_batch(spec, fields, system, s)).item()
                         for s in range(3)], system.precision(), system.notes,
                        {p.dtype for p in system.model.parameters()})
    assert "layers: one torch.compile (inductor) region each" in " ".join(runs[True][2])
    assert runs[True][0] == pytest.approx(runs[False][0], rel=LOSS_TOLERANCE)
    assert runs[True][3] == {BF16} and runs[False][3] == {torch.float32}
    assert runs[False][1] == "bf16 autocast over fp32 parameters (the master weights)"
    assert runs[True][1].startswith("bfloat16 parameters (")
    assert runs[True][1].endswith("no autocast: activations, residual stream and norms in "
                                  "bfloat16, the loss in float32 (as Megatron-LM and "
                                  "DeepSpeed train in bf16)")


def test_slapo_tp_keeps_autocast_where_the_model_computes_its_own_loss(slapo_bf16_on_cpu):
    """WideResNet's schedule installs no loss (the model's own would be computed in bf16):
    its Slapo-TP trains under autocast over fp32 parameters, as the baselines."""
    from slapo_ae.harness.systems import slapo_tp
    from slapo_ae.harness.worker import model_fields, step_batch

    spec = _spec("wideresnet-tiny")
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    system = slapo_tp.SlapoTPSystem(spec, ctx)
    system.setup()
    loss = system.train_step(step_batch(spec, model_fields(spec), system, 0))
    assert torch.isfinite(loss)
    assert system.master_weights is None
    assert {p.dtype for p in system.model.parameters()} == {torch.float32}
    assert system.precision() == "bf16 autocast over fp32 parameters (the master weights)"


def _megatron(model: str, bf16: bool, fused: bool = False):
    """megatron-core's model on CPU, in bf16 (made to run there) or fp32, with the fusions
    it has on CUDA or none (as on CPU): 3 steps' losses, the record's precision, the
    parameters' dtypes and the config's bf16 flag. Fused, dropout is off, so that the fused
    runs in the two precisions differ in their arithmetic alone (a mask drawn for a bf16
    tensor need not be the one drawn for a float32 one)."""
    from megatron.core import parallel_state

    from slapo_ae.harness.systems.megatron import MegatronSystem, cuda_fusions
    from slapo_ae.harness.worker import model_fields, step_batch

    class OnCPU(MegatronSystem):
        def set_precision(self):
            self.autocast_dtype, self.scaler = (BF16 if bf16 else None), None

        def fusions(self):
            return cuda_fusions(self.family, fp32_weights=not bf16)[0] if fused else {}

    spec = _spec(model, mode="megatron", dec_seq_len=8 if model.startswith("t5") else 0,
                 no_dropout=fused)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    system = OnCPU(spec, ctx)
    system.setup()
    fields = model_fields(spec)
    losses = [float(system.train_step(step_batch(spec, fields, system, s))) for s in range(3)]
    config = next(m.config for m in system.model.modules() if hasattr(m, "config"))
    parallel_state.destroy_model_parallel()
    return losses, system.precision(), {p.dtype for p in system.model.parameters()}, config.bf16


def _megatron_bf16_and_fp32(model):
    return _megatron(model, bf16=True), _megatron(model, bf16=False)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["bert-tiny", "llama-tiny", "gpt-neo-tiny", "t5-tiny"])
def test_megatron_trains_in_bf16_as_megatron_lm_does(model):
    """The megatron baseline trains in bf16 as Megatron-LM does (the whole model in bf16, the
    softmax and loss in float32): every step's loss within LOSS_TOLERANCE of fp32's. (Not of
    autocast's: megatron-core's linear layers restore CUDA's autocast state in their backward,
    so CPU autocast cannot run them.)"""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from distributed import run_ranks

    bf16, fp32 = run_ranks(_megatron_bf16_and_fp32, model, world_size=1)[0]
    assert bf16[0] == pytest.approx(fp32[0], rel=LOSS_TOLERANCE)
    assert bf16[0] != fp32[0]  # it did run in bf16
    assert bf16[2:] == ({BF16}, True) and fp32[2:] == ({torch.float32}, False)
    assert bf16[1].startswith("bfloat16 parameters (") and "no autocast" in bf16[1]
    assert fp32[1] == "fp32"


def _megatron_fused_bf16_and_fp32(model):
    return _megatron(model, bf16=True, fused=True), _megatron(model, bf16=False, fused=True)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["bert-tiny", "llama-tiny", "gpt-neo-tiny"])
def test_megatrons_cuda_fusions_run_on_the_bf16_model(model):
    """What the one-GPU check runs: megatron-core's CUDA fusions (its jit fuser is
    torch.compile, which runs on CPU too) on the whole model in bf16, against the same fused
    model in fp32: every step's loss within LOSS_TOLERANCE."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from distributed import run_ranks

    bf16, fp32 = run_ranks(_megatron_fused_bf16_and_fp32, model, world_size=1)[0]
    assert bf16[0] == pytest.approx(fp32[0], rel=LOSS_TOLERANCE)
    assert bf16[0] != fp32[0]  # it did run in bf16
    assert bf16[2:] == ({BF16}, True)


def test_megatrons_rms_norm_note_only_under_autocast():
    from slapo_ae.harness.systems.megatron import cuda_fusions

    assert "unfused path" in cuda_fusions("llama")[1]
    assert "RMSNorm" not in cuda_fusions("llama", fp32_weights=False)[1]
