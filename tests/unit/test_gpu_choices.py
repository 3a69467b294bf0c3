"""The CUDA choices of the harness and the schedules, checked on CPU where their code runs here:
the optimizer and precision each record states, hf-liger's support rules and its patching
(against a stand-in for liger-kernel, whose Triton kernels need a GPU), megatron-core's fusions
without Transformer Engine (trained on CPU against the unfused model), the schedules' device
options and the ``compile`` primitive's rules."""
from __future__ import annotations

import importlib.metadata
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import slapo
from slapo.model_schedule import ScheduleOptions, schedule_model
from slapo_ae.case import Case
from slapo_ae.harness.runspec import RunSpec
from slapo_ae.harness.systems import base, support
from slapo_ae.harness.systems.support import Unsupported
from slapo_ae.zoo import build_model, synthetic_batch


def _spec(mode="eager", model="llama-tiny", device="cpu", dtype="fp32", **fields):
    case = Case(mode=mode, model=model, gpus=1, seq_len=16, dec_seq_len=0, batch_size=2,
                batch_expr="2", ckpt=0.0, steps=2, warmup=1, device=device, dtype=dtype,
                **fields)
    return RunSpec(case=case, out="r.json")


# --- the optimizer and the precision a record states ------------------------------------
def test_adamw_is_fused_on_cuda_and_the_record_says_which_implementation():
    params = [torch.nn.Parameter(torch.ones(3))]
    cpu = base.adamw(params, 1e-3, torch.device("cpu"))
    assert base.optimizer_name(cpu) == "torch.optim.adamw.AdamW (for-loop)"
    cuda = base.adamw(params, 1e-3, torch.device("cuda"))
    assert cuda.defaults["fused"] is True
    assert base.optimizer_name(cuda) == "torch.optim.adamw.AdamW (fused)"
    explicit = torch.optim.AdamW(params, foreach=True)
    assert base.optimizer_name(explicit) == "torch.optim.adamw.AdamW (foreach)"


def test_zero3_systems_clip_no_gradients_as_no_other_system_does():
    """DeepSpeed's engine clips the gradients' norm at 1.0 by default; the ZeRO-3 systems'
    configuration turns it off, so that every system runs the same training loop."""
    from deepspeed.runtime.config import get_gradient_clipping

    from slapo_ae.harness.systems.deepspeed_zero3 import ds_config

    assert get_gradient_clipping({}) == 1.0  # DeepSpeed's default, which the harness overrides
    for device, dtype in (("cpu", "fp32"), ("cuda", "bf16"), ("cuda", "fp16")):
        config = ds_config(_spec("deepspeed", device=device, dtype=dtype), micro_batch=2)
        assert get_gradient_clipping(config) == 0.0


def test_slapo_3d_runs_its_forward_under_deepspeeds_own_autocast_in_bf16_on_cuda():
    """Around its forward DeepSpeed turns off an autocast it finds on unless its config's
    torch_autocast section is on (tests/static/test_static_deepspeed_pipe.py shows both): so
    the bf16 case's config has it, marking no module for bf16 gradient reduction."""
    from deepspeed.runtime.config import (
        get_gradient_clipping,
        get_lower_precision_safe_modules,
        get_torch_autocast_dtype,
        get_torch_autocast_enabled,
    )

    from slapo_ae.harness.systems.slapo_3d import pipeline_config

    def config(device, dtype):
        return pipeline_config(Case(mode="slapo-megatron", model="llama-tiny", gpus=4,
                                    seq_len=16, dec_seq_len=0, batch_size=8, batch_expr="8",
                                    ckpt=0.0, device=device, dtype=dtype, pp=2, tp=2,
                                    micro_batch=2))

    bf16 = config("cuda", "bf16")
    assert get_torch_autocast_enabled(bf16) and get_torch_autocast_dtype(bf16) == torch.bfloat16
    assert get_lower_precision_safe_modules(bf16) == []
    assert (bf16["train_micro_batch_size_per_gpu"], bf16["gradient_accumulation_steps"]) == (2, 4)
    for plain in (config("cpu", "fp32"), config("cuda", "fp32")):
        assert not get_torch_autocast_enabled(plain)
    assert get_gradient_clipping(bf16) == 0.0


class _Trainer(base.NativeTrainer):
    def setup(self):
        self.model = torch.nn.Linear(2, 2)
        self.make_optimizer()


@pytest.mark.parametrize("dtype,device,policy", [
    ("fp32", "cpu", "fp32"),
    ("bf16", "cuda", "bf16 autocast over fp32 parameters (the master weights)"),
    ("fp16", "cuda", "fp16 autocast over fp32 parameters (the master weights), dynamic loss "
                     "scaling"),
])
def test_native_trainers_state_their_precision_policy(dtype, device, policy, monkeypatch):
    # a GradScaler for fp16 on "cuda" is built without touching a GPU
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: object())
    ctx = base.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device(device))
    system = _Trainer(SimpleNamespace(case=SimpleNamespace(dtype=dtype, lr=1e-3,
                                                           batch_size=2)), ctx)
    system.setup()
    info = system.info()
    assert info["precision"] == policy
    assert info["optimizer"].endswith("(fused)" if device == "cuda" else "(for-loop)")


# --- hf-liger ------------------------------------------------------------------------------
def test_hf_liger_needs_a_gpu_and_liger_kernel(monkeypatch):
    with pytest.raises(Unsupported, match="Triton kernels for GPUs; they do not run on CPU"):
        support.check(_spec("hf-liger"))
    monkeypatch.setattr(support.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(Unsupported, match=r"liger-kernel is not installed \(the project's 'gpu' "
                                          r"extra: pip install '.\[gpu\]'\)"):
        support.check(_spec("hf-liger", device="cuda", dtype="bf16"))


@pytest.fixture
def liger_source(tmp_path, monkeypatch):
    """liger-kernel 0.8.5 installed as the parent process finds it: its package on the path,
    whose import fails (the parent must read the table without importing liger-kernel).
    Returns the file of the table."""
    package = tmp_path / "liger_kernel"
    (package / "transformers").mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("liger-kernel was imported")\n')
    (package / "transformers" / "__init__.py").write_text("")
    table = package / "transformers" / "monkey_patch.py"
    table.write_text("import torch\n\nMODEL_TYPE_TO_APPLY_LIGER_FN = {\n"
                     '    "mistral": apply_liger_kernel_to_mistral,\n'
                     '    "llama": apply_liger_kernel_to_llama,\n}\n')
    metadata = tmp_path / "liger_kernel-0.8.5.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: liger-kernel\n"
                                       "Version: 0.8.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return table


def test_hf_liger_refuses_a_family_without_a_patch_before_a_rank_starts(liger_source):
    """On one H100 (62ef84e) each refusal took 11-14 s of a 4-minute part: a rank started,
    imported torch and liger-kernel, and asked its table. The parent reads the table from
    liger-kernel's source instead, with the rank's reason."""
    cuda = {"device": "cuda", "dtype": "bf16"}
    assert support.liger_model_types() == ["mistral", "llama"]
    with pytest.raises(Unsupported, match=r"^liger-kernel 0.8.5 has no kernels for bert models "
                                          r"\(it patches: llama, mistral\)$"):
        support.check(_spec("hf-liger", model="bert-tiny", **cuda))
    support.check(_spec("hf-liger", model="llama-tiny", **cuda))
    assert "liger_kernel" not in sys.modules
    # a table that is not a dict with string keys in that file: the rank asks liger-kernel
    liger_source.write_text("MODEL_TYPE_TO_APPLY_LIGER_FN = dict(llama=apply)\n")
    assert support.liger_model_types() is None
    support.check(_spec("hf-liger", model="bert-tiny", **cuda))
    liger_source.unlink()
    assert support.liger_model_types() is None


@pytest.fixture
def fake_liger(monkeypatch):
    """liger-kernel's table of patches, with one patch that records its call."""
    calls = []

    def apply_liger_kernel_to_llama(rope=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True, rms_norm=True,
                                    swiglu=True, model=None):
        calls.append(model)

    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_liger_kernel_to_llama,
                                          "mistral": apply_liger_kernel_to_llama}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, patch.__name__, patch)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda dist: "0.8.5" if dist == "liger-kernel" else real_version(dist))
    return calls


def test_hf_liger_applies_liger_kernels_own_patch_for_the_model_type(fake_liger):
    from slapo_ae.harness.systems.eager import apply_liger

    model = build_model("llama-tiny")
    note = apply_liger(model)
    assert fake_liger == [model]
    assert note == ("liger-kernel 0.8.5: apply_liger_kernel_to_llama(model=...), on: rope, "
                    "fused_linear_cross_entropy, rms_norm, swiglu")
    with pytest.raises(Unsupported, match="liger-kernel 0.8.5 has no kernels for bert models "
                                          r"\(it patches: llama, mistral\)"):
        apply_liger(build_model("bert-tiny"))


def test_hf_liger_refuses_a_family_without_a_patch_before_building_the_model(fake_liger,
                                                                              monkeypatch):
    """On one H200, hf-liger's bert-large case took 17 s to say it was unsupported, most of
    them building the model; the patch table is asked first."""
    from slapo_ae.harness.systems import eager

    def build_hf_model(*args):
        raise AssertionError("the model was built")

    monkeypatch.setattr(eager, "build_hf_model", build_hf_model)
    ctx = base.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    system = eager.HFLigerSystem(_spec("hf-liger", model="bert-tiny", device="cuda",
                                       dtype="bf16"), ctx)
    with pytest.raises(Unsupported, match="no kernels for bert models"):
        system.setup()
    system = eager.HFLigerSystem(_spec("hf-liger", model="llama-tiny", device="cuda",
                                       dtype="bf16"), ctx)
    with pytest.raises(AssertionError, match="the model was built"):
        system.setup()


# --- megatron-core's fusions -----------------------------------------------------------------
def test_megatron_fusions_by_family():
    from slapo_ae.harness.systems.megatron import cuda_fusions

    fields, note = cuda_fusions("llama")
    assert fields["bias_activation_fusion"]
    assert fields["activation_func"] is torch.nn.functional.silu
    assert fields["bias_dropout_fusion"] and fields["cross_entropy_loss_fusion"]
    assert "(swiglu)" in note and "DotProductAttention" in note
    # the c740c4e H200 log: "Mismatch dtype between input and weight ... Cannot dispatch to
    # fused implementation" from torch's RMSNorm under bf16 autocast
    assert "RMSNorm is torch's" in note and "unfused path" in note
    fields, note = cuda_fusions("gpt_neo")  # megatron fuses GeLU as GPT-Neo's tanh GeLU
    assert fields["activation_func"] is torch.nn.functional.gelu and "tanh approximation" in note
    assert "RMSNorm" not in note  # LayerNorm
    fields, _ = cuda_fusions("t5")  # ReLU: no activation fusion
    assert "bias_activation_fusion" not in fields and "activation_func" not in fields


def _megatron_losses(model: str, fused: bool) -> list[float]:
    from slapo_ae.harness.systems.megatron import MegatronSystem, cuda_fusions

    class FusedOnCPU(MegatronSystem):
        def fusions(self):  # the CUDA path's fields, on CPU
            return cuda_fusions(self.family)[0] if fused else {}

    spec = _spec("megatron", model=model, no_dropout=True)
    ctx = base.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    system = FusedOnCPU(spec, ctx)
    system.setup()
    losses = []
    for step in range(2):
        batch = synthetic_batch(model, 2, 16, seed=step)
        losses.append(float(system.train_step(batch)))
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return losses


def _fused_and_plain(model):
    return _megatron_losses(model, True), _megatron_losses(model, False)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-tiny", "gpt-neo-tiny", "bert-tiny"])
def test_megatron_fusions_train_as_the_unfused_model(model):
    """megatron-core's jit fuser is torch.compile, which runs on CPU too: the fused model's
    losses equal the unfused one's (tanh GeLU for BERT's erf GeLU: 1e-3)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    from distributed import run_ranks

    fused, plain = run_ranks(_fused_and_plain, model, world_size=1)[0]
    tol = 1e-3 if model == "bert-tiny" else 1e-5
    assert fused == pytest.approx(plain, rel=tol), (fused, plain)


# --- the schedules' device options and the compile primitive ----------------------------
def test_schedule_options_choose_compiled_layers_on_cuda_only():
    assert ScheduleOptions(device="cuda").compile_layers is True
    assert ScheduleOptions(device="cpu").compile_layers is False
    assert ScheduleOptions(device="cuda", kernel_opt=False).compile_layers is False
    assert ScheduleOptions(device="cuda", compile_layers=False).compile_layers is False
    assert ScheduleOptions().device == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        ScheduleOptions(device="tpu")


def test_cuda_schedule_compiles_each_layer_and_keeps_linears_whole():
    from slapo import state

    model = build_model("bert-tiny")
    sch = slapo.create_schedule(model)
    schedule_model(sch, tensor_parallel=False, kernel_opt=True, device="cuda")
    layers = model.bert.encoder.layer
    assert all(state.is_compiled(layer) for layer in layers)
    # no decomposition: cuBLAS keeps the bias in the Linear's epilogue
    assert all(type(layer.intermediate.dense) is torch.nn.Linear for layer in layers)
    cpu = build_model("bert-tiny")
    schedule_model(slapo.create_schedule(cpu), tensor_parallel=False, kernel_opt=True,
                   device="cpu")
    assert not any(state.is_compiled(m) for m in cpu.modules())


@pytest.mark.parametrize("name, masks", [("bert-tiny", [None]), ("llama-tiny", [None]),
                                         ("opt-tiny", [None]), ("gpt-neo-tiny", [None, "local"])])
def test_unpadded_batches_reach_sdpa_without_a_mask(monkeypatch, name, masks):
    """Where nothing is padded the schedule's attention calls SDPA with no mask (causal by
    ``is_causal``), which lets CUDA pick its flash or cuDNN kernel: the model drops an all-ones
    mask in its eager forward, before the (compiled) layers. GPT-Neo's local layers keep their
    window's mask. (The HF model under torch.compile passes SDPA a written-out mask instead:
    the next test.)"""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention

    def recorder(query, key, value, attn_mask=None, **kwargs):
        calls.append("local" if attn_mask is not None else None)
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    model = build_model(name).eval()  # no dropout: SDPA on CPU too
    schedule_model(slapo.create_schedule(model), tensor_parallel=False, kernel_opt=True,
                   device="cpu")
    monkeypatch.setattr(F, "scaled_dot_product_attention", recorder)
    with torch.no_grad():
        model(**synthetic_batch(model.config, 2, 16, 0, seed=0))
    assert sorted(set(calls), key=str) == masks, calls


def test_hf_compile_passes_sdpa_a_written_out_mask():
    """What the schedules have over ``hf-compile`` in attention, kept true: under
    torch.compile, the HF model (SDPA attention) hands SDPA a mask even where nothing is
    padded, which rules its flash kernel out. (A fact of transformers, checked so that
    docs/gpu.md does not go stale.)"""
    masks = []

    def backend(graph_module, inputs):
        masks.extend(node.kwargs.get("attn_mask") is not None for node in graph_module.graph.nodes
                     if node.target is torch.nn.functional.scaled_dot_product_attention)
        return graph_module.forward

    model = build_model("bert-tiny", attn_implementation="sdpa").eval()
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend)(**synthetic_batch(model.config, 2, 16, 0,
                                                                    seed=0))
    finally:
        torch._dynamo.reset()  # no compiled entry of BERT's code left for later tests
    assert masks and all(masks), masks


def test_cuda_schedule_compiles_the_loss_and_berts_head_transform():
    from slapo import state
    from slapo.op.cross_entropy import compiled_output_loss

    model = build_model("bert-tiny")
    schedule_model(slapo.create_schedule(model), tensor_parallel=False, kernel_opt=True,
                   device="cuda")
    assert state.is_compiled(model.cls.predictions.transform)
    assert state.loss_fn(model).func is compiled_output_loss  # what a pipeline's stage takes
    assert "forward" in model.__dict__  # the root computes its loss through it
    cpu = build_model("bert-tiny")
    schedule_model(slapo.create_schedule(cpu), tensor_parallel=False, kernel_opt=True,
                   device="cpu")
    assert state.loss_fn(cpu) is None and "forward" not in cpu.__dict__


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cross_entropy_is_hfs_loss_forward_and_backward(dtype):
    """Inductor on CPU: the compiled loss and its gradient equal the eager float32 loss's
    (HF's: up-cast, then the mean over tokens not labelled -100), the gradient in the
    logits' dtype."""
    import torch.nn.functional as F

    from slapo.op import compiled_cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=gen).to(dtype).requires_grad_()
    target = torch.randint(0, 50, (3, 7), generator=gen)
    target[0, :3] = -100
    eager = logits.detach().clone().requires_grad_()
    expected = F.cross_entropy(eager.float().flatten(0, 1), target.flatten(), ignore_index=-100)
    expected.backward()
    loss = compiled_cross_entropy(logits, target)
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad, eager.grad, rtol=1e-5 if dtype is torch.float32
                               else 1.6e-2, atol=1e-7)
    assert logits.grad[0, :3].abs().max() == 0  # ignored tokens: no gradient
    with pytest.raises(ValueError, match=r"logits \(3, 7, 50\) and target \(3, 6\) disagree"):
        compiled_cross_entropy(logits, target[:, :6])



@pytest.mark.slow
def test_compiled_cross_entropy_reads_padded_logits_from_the_padded_product():
    """``PaddedLinear``'s logits are the real columns of a padded product: the compiled loss
    takes the padded tensor and slices inside its region, so that its backward writes the
    padded gradient itself. The slice outside never runs its backward (a hook on it stays
    silent), and the loss and the gradients are the unpadded product's (Inductor on CPU,
    fp32: 1e-6). Logits that are no such slice (the last columns) go in as they are."""
    import torch.nn.functional as F

    from slapo.op import compiled_cross_entropy, padded_linear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=gen, requires_grad=True)
    weight = torch.randn(30, 16, generator=gen, requires_grad=True)
    target = torch.randint(0, 30, (2, 5), generator=gen)
    logits = padded_linear(x, weight, multiple=8)  # 30 words padded to 32
    assert logits._base.shape == (2, 5, 32)
    sliced_backward = []
    logits.register_hook(sliced_backward.append)
    compiled_cross_entropy(logits, target).backward()
    assert sliced_backward == []
    got = (x.grad, weight.grad)
    x.grad = weight.grad = None
    expected = F.cross_entropy(F.linear(x, weight).flatten(0, 1), target.flatten())
    expected.backward()
    torch.testing.assert_close(got, (x.grad, weight.grad), rtol=1e-6, atol=1e-6)
    last = F.linear(x, torch.cat([weight[:2], weight]))[..., 2:]  # not the leading columns
    torch.testing.assert_close(compiled_cross_entropy(last, target), expected,
                               rtol=1e-6, atol=1e-6)

@pytest.mark.parametrize("model,device,compile_kernels,kernel", [
    ("bert-tiny", "cpu", "auto", "eager"),  # fused (a module), run eagerly on CPU
    ("gpt-neo-tiny", "cpu", "auto", "eager"),  # replaced (a call) by slapo.op.bias_gelu
    ("llama-tiny", "cpu", "auto", "none"),  # SwiGLU, no GeLU
    ("bert-tiny", "cuda", "0", "none")])  # CUDA with nothing to compile it: HF's own Linear
def test_the_record_says_whether_the_schedule_fused_bias_and_gelu(
        model, device, compile_kernels, kernel, monkeypatch):
    """The kernel note's bias_gelu entry follows what the schedule did to the model, whichever
    primitive did it. The model is scheduled on the CPU for CUDA as Slapo-ZeRO3's is."""
    from slapo.op.gelu import ENV_COMPILE
    from slapo_ae.harness.systems.slapo_tp import has_fused_bias_gelu, schedule

    monkeypatch.setenv(ENV_COMPILE, compile_kernels)
    ctx = base.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    notes = []
    sch = schedule(_spec("slapo-kernel", model=model, device=device), ctx, notes,
                   trains_on=torch.device(device), tensor_parallel=False, kernel_opt=True,
                   compile_layers=False)
    assert has_fused_bias_gelu(sch.mod) == (kernel != "none")
    entry = next(part for part in notes[0].split("; ") if part.startswith("bias_gelu: "))
    assert entry == ("bias_gelu: none (the model's own Linear and activation)"
                     if kernel == "none" else f"bias_gelu: {kernel}")


@pytest.mark.parametrize("version", ["2.13.0", "2.11.0+cu130"])
def test_slapo_zero3_compiles_its_layers_on_cuda_and_runs_torch_linear_in_them(
        version, monkeypatch):
    """Slapo-ZeRO3 on CUDA compiles its layers as Slapo-TP does, with the device machines'
    torch too, and hands DeepSpeed a config whose ZeRO-3 keeps torch's linear in them (with
    DeepSpeed's own, torch 2.11's compiled Linear layers with a bias got no gradients:
    slapo.engines.with_torch_linear); its notes say so. Its schedule is built on the CPU
    (DeepSpeed moves the model), so this runs here; the build itself is stubbed."""
    import slapo
    from slapo import state
    from slapo_ae.harness.systems.slapo_zero3 import SlapoZero3System

    monkeypatch.setattr(torch, "__version__", version)
    ctx = base.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    system = SlapoZero3System(_spec("slapo-deepspeed", model="bert-tiny", device="cuda",
                                    dtype="bf16"), ctx)
    model = system.build()
    assert all(state.is_compiled(layer) for layer in model.bert.encoder.layer)
    handed = {}
    monkeypatch.setattr(slapo, "build", lambda sch, **kw: (handed.update(kw) or ("engine", 0)))
    config = {"zero_optimization": {"stage": 3}}
    assert system.initialize("optimizer", config) == "engine"
    assert handed["config"] is config and handed["zero3_layer_leaves"] is True
    notes = " | ".join(system.notes)
    assert "layers: one torch.compile" in notes
    assert "ZeRO-3 memory-efficient linear off: compiled regions run torch's linear" in notes
    assert "ZeRO-3 leaf modules: 3, the transformer layers and compiled regions" in notes


def test_compile_comes_before_checkpoint_and_once():
    import torch._dynamo

    model = build_model("llama-tiny")
    sch = slapo.create_schedule(model)
    layer = sch["model.layers.0"]
    layer.compile()
    compiled = model.model.layers[0].forward
    layer.compile()  # a no-op
    assert model.model.layers[0].forward is compiled
    assert torch._dynamo.config.recompile_limit >= 64
    other = sch["model.layers.1"]
    other.checkpoint()
    with pytest.raises(ValueError, match="compile 'model.layers.1' before checkpointing it"):
        other.compile()
    with pytest.raises(ValueError, match="unknown compiler 'nonesuch'"):
        sch["model.norm"].compile(backend="nonesuch")
