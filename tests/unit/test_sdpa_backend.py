"""SDPA's kernel measured on the device at the first call of each shape
(``slapo.op.sdpa_backend``), run here on CPU, where SDPA has two kernels of its own (flash and
math): the order, the checks that leave a kernel out, the record's lines, and the choice made
once while ``torch.compile`` traces a region, with the same numbers as SDPA's own choice.
On CUDA the candidates are cuDNN, flash and memory-efficient attention; a GPU runs those."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slapo.op import attention, kernel_choices, sdpa_backend


@pytest.fixture
def measured_on_cpu(monkeypatch):
    monkeypatch.setattr(sdpa_backend, "MEASURED_ON", ("cpu",))
    monkeypatch.setattr(sdpa_backend, "_MEASURED", {})
    monkeypatch.setattr(sdpa_backend, "WARMUP", 1)
    monkeypatch.setattr(sdpa_backend, "REPEATS", 2)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(kv_heads=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 32, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, kv_heads, 32, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, kv_heads, 32, 8, generator=gen, requires_grad=True)
    return q, k, v


def _call(**fields):
    bshd = (32 * 4 * 8, 8, 4 * 8, 1)  # a [2, 32, 4 * 8] projection's view as [2, 4, 32, 8]
    shape = dict(batch=2, heads=4, kv_heads=4, q_len=32, k_len=32, head_dim=8,
                 strides=(bshd, bshd, bshd), dtype="float32", device="cpu", causal=False,
                 dropout_p=0.0, scale=None)
    return sdpa_backend.AttentionCall(**{**shape, **fields})


def test_not_measured_where_not_asked():
    assert not sdpa_backend.measures("cpu")
    assert sdpa_backend.measures("cuda")
    assert "measured fastest" in kernel_choices("cuda")["attention"]
    assert "measured" not in kernel_choices("cpu")["attention"]


def test_chunked_local_attention_is_claimed_only_for_a_model_with_a_window():
    assert "local_attention" not in kernel_choices("cuda")["attention"]  # OPT, BERT, LLaMA
    assert "local_attention" in kernel_choices("cuda", local_window=True)["attention"]
    assert "local_attention" not in kernel_choices("cpu", local_window=True)["attention"]


def test_every_candidate_that_agrees_is_timed_and_ordered_fastest_first(measured_on_cpu):
    result = sdpa_backend.measure(_call(causal=True))
    assert set(result["order"]) == {"FLASH_ATTENTION", "MATH"}
    assert result["excluded"] == {}
    assert all(t > 0 for t in result["times_ms"].values())
    # the order is the times' (whichever way a loaded machine timed them)
    assert result["order"] == sdpa_backend.fastest_first(result["times_ms"], "FLASH_ATTENTION")
    assert result["sdpa_own"] == "FLASH_ATTENTION"  # CPU's SDPA: its flash kernel, no dropout


def test_a_backend_that_cannot_serve_the_call_is_left_out_with_the_reason(
        measured_on_cpu, monkeypatch):
    # the memory-efficient kernel is CUDA's only
    monkeypatch.setitem(sdpa_backend.CANDIDATES, "cpu", ("EFFICIENT_ATTENTION", "MATH"))
    result = sdpa_backend.measure(_call())
    assert result["order"] == ("MATH",)
    assert result["excluded"]["EFFICIENT_ATTENTION"].startswith("cannot serve the call: ")


def test_a_kernel_at_fault_is_left_out_even_when_it_is_sdpas_own_pick(
        measured_on_cpu, monkeypatch):
    """Each kernel is checked against the float32 math kernel, not against SDPA's own pick
    (on CPU its flash kernel): a flash kernel wrong at a shape agrees with itself."""
    from torch.nn.attention import SDPBackend

    real = sdpa_backend._forward_backward

    def faulty_flash(backend, q, k, v, grad, kwargs):
        out = real(backend, q, k, v, grad, kwargs)
        if backend in (None, SDPBackend.FLASH_ATTENTION):  # SDPA's own pick is flash here
            return tuple(t * 1.1 for t in out)
        return out

    monkeypatch.setattr(sdpa_backend, "_forward_backward", faulty_flash)
    result = sdpa_backend.measure(_call(dtype="bfloat16"))
    assert result["sdpa_own"] == "FLASH_ATTENTION" and result["order"] == ("MATH",)
    assert result["excluded"]["FLASH_ATTENTION"].endswith("against the float32 math kernel")


def test_a_backend_that_disagrees_with_the_reference_is_left_out(
        measured_on_cpu, monkeypatch):
    monkeypatch.setattr(sdpa_backend, "AGREEMENT", -1.0)  # nothing agrees, not even itself
    result = sdpa_backend.measure(_call())
    assert result["order"] == ()
    assert set(result["excluded"]) == {"FLASH_ATTENTION", "MATH"}
    assert all("relative error" in why for why in result["excluded"].values())
    line, = sdpa_backend.describe([{**vars(_call()), **result}])
    assert "none ran -> SDPA default" in line and "left out: FLASH_ATTENTION" in line


def test_measured_once_per_shape_and_listed_for_the_record(measured_on_cpu):
    q, k, v = _qkv()
    attention(q, k, v, causal=True)
    attention(q, k, v, causal=True)
    attention(q, k, v)  # another call: not causal
    measured = sdpa_backend.measurements()
    assert [m["causal"] for m in measured] == [True, False]
    assert measured[0]["batch"] == 2 and measured[0]["device"] == "cpu"
    line = sdpa_backend.describe(measured)[0]
    assert line.startswith("SDPA kernel measured on cpu for [2, 4, 32, 8] float32 causal, "
                           "dropout 0, forward and backward: ")
    assert line.endswith(f"-> {measured[0]['order'][0]} (SDPA's own pick: FLASH_ATTENTION)")


def test_the_training_random_stream_is_left_as_it_was(measured_on_cpu):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    sdpa_backend.measure(_call(dropout_p=0.1))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("kv_heads", [4, 2])  # grouped-query attention too
def test_attention_under_the_measured_kernel_equals_sdpa_eager_and_compiled(
        measured_on_cpu, kv_heads):
    q, k, v = _qkv(kv_heads)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=kv_heads != 4)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))

    def run(q, k, v):
        return attention(q, k, v, causal=True)

    explained = torch._dynamo.explain(run)(q, k, v)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    for fn in (run, torch.compile(run)):
        out = fn(q, k, v)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(sdpa_backend.measurements()) == 1  # the trace reused the eager call's choice


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-tiny", "llama-tiny"])
def test_compiled_schedule_measures_inside_its_layers_and_trains_as_the_plain_model(
        measured_on_cpu, name):
    """The GPU path end to end, on CPU: each layer one compiled region whose attention (no
    mask: nothing is padded) runs on the measured kernel; one graph per region, the plain
    model's loss and gradients."""
    import slapo
    from slapo.model_schedule import schedule_model
    from slapo_ae.zoo import build_model, synthetic_batch

    torch.manual_seed(0)
    plain = build_model(name).eval()  # no dropout: SDPA itself on CPU too
    scheduled = build_model(name).eval()
    scheduled.load_state_dict(plain.state_dict())
    schedule_model(slapo.create_schedule(scheduled), tensor_parallel=False, kernel_opt=True,
                   device="cpu", compile_layers=True)
    batch = synthetic_batch(plain.config, 2, 16, seed=0)
    losses = []
    for model in (plain, scheduled):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-6)
    grads = dict(scheduled.named_parameters())
    for param_name, param in plain.named_parameters():
        got = grads[param_name].grad
        assert float((got - param.grad).norm() / param.grad.norm().clamp_min(1e-3)) < 1e-4, \
            param_name
    measured = sdpa_backend.measurements()
    assert len(measured) == 1 and measured[0]["q_len"] == 16, measured  # all layers alike
    assert measured[0]["causal"] == (name == "llama-tiny")


def test_the_harness_puts_the_measurements_in_the_record(measured_on_cpu):
    from slapo_ae.harness.worker import measured_attention_kernels

    assert measured_attention_kernels() == []
    q, k, v = _qkv()
    attention(q, k, v)
    assert measured_attention_kernels() == sdpa_backend.measurements() != []


def test_under_autocast_the_kernel_is_measured_in_the_dtype_sdpa_computes_in(measured_on_cpu):
    """LLaMA's queries leave the rotary embedding in float32 and autocast casts them for SDPA:
    measured in float32, CUDA's flash and cuDNN kernels (16-bit only) would be left out."""
    q, k, v = _qkv()

    def run(q, k, v):
        return attention(q, k, v, causal=True)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(run)(q, k, v)
        out = torch.compile(run)(q, k, v)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert out.dtype == torch.bfloat16
    assert [m["dtype"] for m in sdpa_backend.measurements()] == ["bfloat16"]


def test_a_masked_call_is_measured_with_a_mask_of_its_shape_and_dtype(measured_on_cpu):
    q, k, v = _qkv()
    padding = torch.ones(2, 1, 1, 32, dtype=torch.bool)
    padding[0, ..., -5:] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=padding)
    torch.testing.assert_close(attention(q, k, v, padding), expected, rtol=1e-5, atol=1e-5)
    bias = torch.randn(1, 4, 32, 32)
    attention(q, k, v, bias=bias)
    # a bias that trains (T5's position bias) is another call: cuDNN's kernel refuses it
    attention(q, k, v, bias=bias.clone().requires_grad_())
    masks = [m["mask"] for m in sdpa_backend.measurements()]
    assert masks == [((2, 1, 1, 32), "bool", False), ((1, 4, 32, 32), "float32", False),
                     ((1, 4, 32, 32), "float32", True)]
    lines = sdpa_backend.describe(sdpa_backend.measurements())
    assert "with a bool mask [2, 1, 1, 32], dropout" in lines[0]
    assert "with a float32 mask [1, 4, 32, 32] that trains" in lines[2]


def test_local_attention_by_chunks_on_measured_kernels_equals_the_dense_call(measured_on_cpu):
    from slapo.op import merge_masks
    from slapo.op.sdpa import local_attention

    q, k, v = _qkv()
    dense = F.scaled_dot_product_attention(
        q, k, v, attn_mask=merge_masks(32, 32, q.dtype, q.device, causal=True, window=8))
    torch.testing.assert_close(local_attention(q, k, v, 8), dense, rtol=1e-5, atol=1e-5)
    calls = {(m["causal"], m["mask"]) for m in sdpa_backend.measurements()}
    assert calls == {(True, None), (False, ((8, 16), "bool", False))}  # first chunk; the band


def test_sdpas_own_pick_stays_first_unless_another_is_clearly_faster():
    times = {"CUDNN_ATTENTION": 1.0, "FLASH_ATTENTION": 1.04, "EFFICIENT_ATTENTION": 2.0}
    assert sdpa_backend.fastest_first(times, "FLASH_ATTENTION") == (
        "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
    assert sdpa_backend.fastest_first(times, "CUDNN_ATTENTION") == (
        "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
    assert sdpa_backend.fastest_first({"CUDNN_ATTENTION": 1.0, "FLASH_ATTENTION": 1.2},
                                      "FLASH_ATTENTION") == ("CUDNN_ATTENTION", "FLASH_ATTENTION")
    # SDPA's own pick not among those timed (math on CUDA, say): by time alone
    assert sdpa_backend.fastest_first({"CUDNN_ATTENTION": 1.0, "EFFICIENT_ATTENTION": 1.03},
                                      "MATH") == ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
    assert sdpa_backend.fastest_first({}, None) == ()


def test_sdpas_own_pick_is_the_kernel_sdpa_runs():
    """Read from SDPA's own selection, not from a fixed list: on sm90/sm100 GPUs with a recent
    cuDNN PyTorch puts cuDNN's attention first, elsewhere flash. Checked against the aten
    kernel SDPA dispatches to, with and without dropout (CPU's flash kernel takes none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ran = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.append(func.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv()
    picks = {}
    for dropout_p in (0.0, 0.1):
        picks[dropout_p] = sdpa_backend.sdpa_pick(q, k, v, {"dropout_p": dropout_p})
        with Kernels() as kernels:
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        flash = "_scaled_dot_product_flash_attention_for_cpu.default" in kernels.ran
        math = "bmm.default" in kernels.ran  # the math kernel is written in aten ops
        assert (flash, math) == (picks[dropout_p] == "FLASH_ATTENTION",
                                 picks[dropout_p] == "MATH"), (picks, kernels.ran)
    assert picks == {0.0: "FLASH_ATTENTION", 0.1: "MATH"}


def test_cudnn_is_not_opted_into_where_sdpa_keeps_it_behind_math(measured_on_cpu, monkeypatch):
    """PyTorch's default priority keeps cuDNN's attention after the math kernel (to be opted
    into) except on the GPUs and cuDNN versions it prefers it for: the measurement reorders
    the kernels SDPA would try before math, and adds none."""
    behind = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION", "OVERRIDEABLE")
    preferred = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH",
                 "OVERRIDEABLE")
    assert not sdpa_backend.trusted("CUDNN_ATTENTION", behind)
    assert sdpa_backend.trusted("CUDNN_ATTENTION", preferred)
    assert sdpa_backend.trusted("FLASH_ATTENTION", behind) and sdpa_backend.trusted("MATH", behind)
    # read from SDPA itself: the priority sdpa_kernel sets is the one read
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert sdpa_backend.sdpa_priority()[:2] == ("MATH", "FLASH_ATTENTION")
    # PyTorch's default where it does not prefer cuDNN (CPU builds; CUDA reorders it on some
    # GPUs at SDPA's first call there, so the test does not rely on the process's own)
    monkeypatch.setattr(sdpa_backend, "sdpa_priority", lambda: behind)
    monkeypatch.setitem(sdpa_backend.CANDIDATES, "cpu", ("CUDNN_ATTENTION", "FLASH_ATTENTION"))
    result = sdpa_backend.measure(_call())
    assert result["order"] == ("FLASH_ATTENTION",)
    assert "behind its math kernel" in result["excluded"]["CUDNN_ATTENTION"]


def test_measured_inside_a_checkpointed_compiled_region(measured_on_cpu):
    """A checkpointed layer compiles inside checkpointing's forward: the measurement's own
    forward and backward must not reach its saved-tensor hooks (they did, as the layer's
    tensors, and the recomputation stopped with _StopRecomputationError under ZeRO-3)."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    region = torch.compile(lambda q, k, v: attention(q, k, v, causal=True) * 2)
    out = checkpoint(region, q, k, v, use_reentrant=False)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(sdpa_backend.measurements()) == 1


def test_a_call_sdpa_itself_cannot_run_is_left_to_sdpa(measured_on_cpu, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("out of memory\nmore")

    monkeypatch.setattr(sdpa_backend, "_forward_backward", refuse)
    result = sdpa_backend.measure(_call())
    assert result == {"order": (), "times_ms": {}, "sdpa_own": None,
                      "excluded": {"all": "SDPA's own kernel did not run: out of memory"}}


def test_the_environment_names_the_devices_to_measure_on():
    assert sdpa_backend.measured_on(None) == ("cuda",)
    assert sdpa_backend.measured_on("cpu, cuda") == ("cpu", "cuda")
    assert sdpa_backend.measured_on("") == ()
    with pytest.raises(ValueError, match=r"SLAPO_SDPA_MEASURE='gpu': unknown device type\(s\) gpu"):
        sdpa_backend.measured_on("gpu")


@pytest.mark.slow
def test_t5s_compiled_blocks_stay_whole_with_the_measurement(measured_on_cpu):
    """T5's block code serves the encoder's length and the decoder's: compiled for dynamic
    shapes (torch's default after a second shape), the measurement's arguments were no
    constants and Dynamo broke the graph at every call; the schedules compile statically."""
    import torch._dynamo.utils

    import slapo
    from slapo.model_schedule import schedule_model
    from slapo_ae.zoo import build_model, no_dropout, synthetic_batch

    torch.manual_seed(0)
    model = build_model("t5-tiny", **no_dropout("t5-tiny"))
    schedule_model(slapo.create_schedule(model), tensor_parallel=False, kernel_opt=True,
                   device="cpu", compile_layers=True)
    torch._dynamo.utils.counters.clear()
    model(**synthetic_batch(model.config, 2, 16, 8, seed=0)).loss.backward()
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert {m["q_len"] for m in sdpa_backend.measurements()} == {16, 8}
