"""The profile's accounting of CUDA time (slapo_ae/harness/profiling.py), on events shaped as
torch.profiler's ``key_averages()`` gives them: each kernel is listed as its own device event
and again in the self device time of the CPU operator that launched it, and annotations have a
GPU-side copy. No GPU is needed: the events are made here."""
from types import SimpleNamespace

from torch.autograd import DeviceType

from slapo_ae.harness.profiling import operators, shaped_operators, summarize


def event(key, cpu_us=0.0, device_us=0.0, device=DeviceType.CPU, annotation=False, flops=0,
          calls=1, shapes=()):
    return SimpleNamespace(key=key, count=calls, self_cpu_time_total=cpu_us,
                           self_device_time_total=device_us, flops=flops, device_type=device,
                           is_user_annotation=annotation, input_shapes=list(shapes))


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


def test_operators_by_input_shape_tell_one_copy_from_another():
    """``key_averages(group_by_input_shape=True)`` lists an operator once per input shapes;
    ops.json's ``by_shape`` keeps the largest CPU-side rows, by kernel time on CUDA."""
    shaped = [
        event("aten::copy_", cpu_us=5, device_us=2100, calls=24,
              shapes=[[8, 1024, 2048], [8, 1024, 2048], []]),
        event("aten::copy_", cpu_us=50, device_us=10, calls=4, shapes=[[16], [16], []]),
        event("unrolled_elementwise_kernel", device_us=2110, device=DeviceType.CUDA, calls=28),
        event("aten::empty", cpu_us=3, shapes=[[], [], []]),
    ]
    rows = shaped_operators(shaped, cuda=True)
    assert [row["input_shapes"] for row in rows] == [[[8, 1024, 2048], [8, 1024, 2048], []],
                                                     [[16], [16], []], [[], [], []]]
    assert rows[0] == {"op": "aten::copy_", "input_shapes": [[8, 1024, 2048], [8, 1024, 2048],
                                                               []],
                       "calls": 24, "self_cpu_us": 5, "self_device_us": 2100}
    on_cpu = shaped_operators(shaped, cuda=False)  # by self CPU time, no device times
    assert [row["self_cpu_us"] for row in on_cpu] == [50, 5, 3]
    assert all("self_device_us" not in row for row in on_cpu)
