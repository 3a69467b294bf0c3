"""The profile's accounting of CUDA time (slapo_ae/harness/profiling.py), on events shaped as
torch.profiler's ``key_averages()`` gives them: each kernel is listed as its own device event
and again in the self device time of the CPU operator that launched it, and annotations have a
GPU-side copy. No GPU is needed: the events are made here."""
from types import SimpleNamespace

from torch.autograd import DeviceType

from slapo_ae.harness.profiling import operators, summarize


def event(key, cpu_us=0.0, device_us=0.0, device=DeviceType.CPU, annotation=False, flops=0,
          calls=1):
    return SimpleNamespace(key=key, count=calls, self_cpu_time_total=cpu_us,
                           self_device_time_total=device_us, flops=flops, device_type=device,
                           is_user_annotation=annotation)


EVENTS = [
    event("aten::mm", cpu_us=40, device_us=900, flops=10**9, calls=4),
    event("nvjet_sm90_gemm", device_us=900, device=DeviceType.CUDA, calls=4),
    event("triton_poi_fused_add_gelu_0", cpu_us=5, device_us=100, annotation=True),
    event("triton_poi_fused_add_gelu_0", device_us=100, device=DeviceType.CUDA),
    event("Optimizer.step#AdamW.step", device_us=300, device=DeviceType.CUDA, annotation=True),
    event("aten::_fused_adamw_", cpu_us=20, device_us=250),
    event("multi_tensor_apply_kernel", device_us=250, device=DeviceType.CUDA),
    event("aten::empty", cpu_us=3),
]


def test_cuda_time_is_counted_once_by_kernel_and_shared_out_by_operator():
    table = operators(EVENTS, cuda=True)
    assert table["device_us"] == 900 + 100 + 250  # kernels; no annotation, no CPU operator
    assert set(table["ops"]) == {"aten::mm", "triton_poi_fused_add_gelu_0",
                                 "aten::_fused_adamw_", "aten::empty"}
    assert table["ops"]["aten::mm"] == {"calls": 4, "self_cpu_us": 40, "self_device_us": 900,
                                        "flops": 10**9}
    assert sum(op["self_device_us"] for op in table["ops"].values()) == table["device_us"]
    summary = summarize(EVENTS, wall_us=2000, table=table)
    assert summary["device_us"] == 1250 and summary["self_cpu_us"] == 68
    assert [op["op"] for op in summary["top_device_ops"]][:3] == [
        "aten::mm", "aten::_fused_adamw_", "triton_poi_fused_add_gelu_0"]


def test_cpu_profiles_keep_their_shape():
    cpu = [e for e in EVENTS if e.device_type == DeviceType.CPU]
    table = operators(cpu, cuda=False)
    assert set(table) == {"ops"} and "self_device_us" not in table["ops"]["aten::mm"]
    assert "top_device_ops" not in summarize(cpu, wall_us=100, table=table)
