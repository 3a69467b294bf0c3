"""bf16 Linear weights with fp32 master copies (slapo_ae/harness/systems/master_weights.py):
autocast's arithmetic over fp32 parameters, step for step, checked on CPU under CPU autocast
(the same casts as CUDA's for a Linear), and the harness's Slapo systems that use it."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from slapo_ae.case import Case
from slapo_ae.harness.runspec import RunSpec
from slapo_ae.harness.systems.base import DistContext, NativeTrainer
from slapo_ae.harness.systems.master_weights import LinearMasterWeights
from slapo_ae.zoo import build_model, synthetic_batch

BF16 = torch.bfloat16


def _train(model, batches, master_weights: bool):
    """Losses and the fp32 values of every parameter after training ``model`` on
    ``batches`` under CPU bf16 autocast with AdamW."""
    weights = LinearMasterWeights(model, BF16) if master_weights else None
    params = weights.optimizer_params if weights else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=BF16):
            loss = model(**batch).loss
        loss.backward()
        if weights:
            weights.step(optimizer)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    masters = dict(zip(weights.names, weights.masters)) if weights else {}
    return losses, {name: masters.get(name, p) for name, p in model.named_parameters()}, weights


def test_bf16_linear_weights_with_masters_train_as_autocast_over_fp32():
    """BERT (dropout on, its decoder tied to the word embeddings), 3 steps: the same losses and
    the same fp32 values, to the bit; the Linear layers hold bf16 weights, the rest fp32."""
    batches = [synthetic_batch("bert-tiny", 4, 16, seed=s) for s in range(3)]
    torch.manual_seed(0)
    reference = _train(build_model("bert-tiny", seed=0), batches, master_weights=False)
    torch.manual_seed(0)
    model = build_model("bert-tiny", seed=0)
    losses, values, weights = _train(model, batches, master_weights=True)
    assert losses == reference[0]
    for name, value in values.items():
        assert value.dtype == torch.float32 and torch.equal(value, reference[1][name]), name
    params = dict(model.named_parameters())
    assert "bert.encoder.layer.0.attention.self.query.weight" in weights.names
    assert "bert.encoder.layer.1.output.dense.bias" in weights.names
    for name in weights.names:
        assert params[name].dtype == BF16
        assert torch.equal(params[name], values[name].to(BF16)), name
    # the decoder's weight and bias are tied (to the word embeddings, to cls.predictions.bias):
    # they stay fp32 under autocast, as do the norms and embeddings
    linears = {f"{path}.{kind}" for path, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) for kind in ("weight", "bias")}
    assert set(weights.names) == linears - {"cls.predictions.decoder.weight",
                                            "cls.predictions.decoder.bias"}
    assert len(weights.names) == 2 * 6 * 2 + 2  # 2 layers of 6 Linears, the head's transform
    assert params["bert.embeddings.word_embeddings.weight"].dtype == torch.float32
    assert params["bert.encoder.layer.0.output.LayerNorm.weight"].dtype == torch.float32


def _spec(model="bert-tiny", mode="slapo-megatron", dtype="bf16"):
    case = Case(mode=mode, model=model, gpus=1, seq_len=16, dec_seq_len=0, batch_size=4,
                batch_expr="4", ckpt=0.0, steps=3, warmup=1, device="cpu", dtype=dtype)
    return RunSpec(case=case, out="r.json")


def test_slapo_systems_use_master_weights_under_bf16_without_data_parallelism():
    from slapo_ae.harness.systems.slapo_tp import slapo_master_weights

    def system(dtype=BF16, dp_size=1):
        return SimpleNamespace(autocast_dtype=dtype, dp_size=dp_size)

    assert slapo_master_weights(system())
    assert not slapo_master_weights(system(dtype=torch.float16))  # loss scaling's own path
    assert not slapo_master_weights(system(dtype=None))  # fp32
    assert not slapo_master_weights(system(dp_size=2))  # DDP would reduce in bf16


def test_slapo_tp_trains_with_master_weights_as_with_autocast(monkeypatch):
    """The harness's Slapo-TP with its schedule's CUDA choices (compiled layers: Inductor on
    CPU, which leaves out the weights' casts), bf16 autocast made to run on CPU: with master
    weights and without, the same losses to the bit; the record says which."""
    import functools

    from slapo_ae.harness.systems import slapo_tp
    from slapo_ae.harness.worker import model_fields, step_batch

    def bf16_on_cpu(self):
        self.autocast_dtype, self.scaler = BF16, None

    monkeypatch.setattr(NativeTrainer, "set_precision", bf16_on_cpu)
    monkeypatch.setattr(slapo_tp, "scheduled_model", functools.partial(
        slapo_tp.scheduled_model, trains_on=torch.device("cuda")))
    spec, ctx = _spec(), DistContext(rank=0, world_size=1, local_rank=0,
                                     device=torch.device("cpu"))
    runs = {}
    for master in (True, False):
        monkeypatch.setattr(slapo_tp.SlapoTPSystem, "uses_master_weights",
                            lambda self, m=master: m)
        system = slapo_tp.SlapoTPSystem(spec, ctx)
        system.setup()
        fields = model_fields(spec)
        runs[master] = ([system.train_step(step_batch(spec, fields, system, s)).item()
                         for s in range(3)], system.precision(), system.notes)
    assert "layers: one torch.compile (inductor) region each" in " ".join(runs[True][2])
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == "bf16 autocast over fp32 parameters (the master weights)"
    assert runs[True][1] == ("bf16 autocast; 26 Linear weight and bias tensors stored in "
                             "torch.bfloat16 with fp32 master copies that the optimizer steps "
                             "(copied each way once a step, torch._foreach_copy_)")
