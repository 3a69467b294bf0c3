"""``slapo-bench run --profile``: every rank profiles its timed steps and the record says so
(a real 2-rank launch, hence slow)."""
import json

import pytest
from harness_util import run_case

pytestmark = pytest.mark.slow


def test_each_rank_writes_its_operator_table_and_the_record_summarises_it(tmp_path):
    prof = tmp_path / "prof"
    _, record = run_case(tmp_path / "r.json", "--mode", "slapo-megatron", "--model", "bert-tiny",
                         "--gpus", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "4",
                         "--warmup", "1", "--profile", prof)
    assert record.status == "ok", record.reason
    for rank in (0, 1):
        ops = json.loads((prof / f"rank{rank}.ops.json").read_text())
        assert ops["steps"] == 3  # the timed steps only
        assert ops["ops"]["aten::mm"]["calls"] > 0
        assert ops["ops"]["aten::mm"]["flops"] > 0  # from the shapes (gaps' matmul rate)
        # by input shapes too: bert-tiny's products read [rows, 64] activations
        shaped = [row for row in ops["by_shape"] if row["op"] == "aten::mm"]
        assert shaped and all(len(row["input_shapes"]) == 2 for row in shaped)
        assert any(64 in row["input_shapes"][0] for row in shaped), shaped
        assert any("allreduce" in name for name in ops["ops"])  # tensor parallelism talks
        assert "aten::mm" in (prof / f"rank{rank}.txt").read_text()
        assert (prof / f"rank{rank}.trace.json").stat().st_size > 0
    summary = record.metrics.extra["profile"]
    assert set(summary) == {"0", "1"}
    assert summary["0"]["collective_self_cpu_us"] > 0 and summary["0"]["top_ops"]
    assert any("profiled with torch.profiler" in n for n in record.metrics.extra["notes"])
    assert any(n.startswith("Slapo kernels on cpu: attention") for n in
               record.metrics.extra["notes"])


def test_profile_after_profiles_more_steps_and_leaves_the_timed_ones_alone(tmp_path):
    """``--profile-after N``: N steps after the timed ones are profiled; the record's step
    times and losses are the timed steps' only, and its notes say which steps were profiled."""
    prof = tmp_path / "prof"
    _, record = run_case(tmp_path / "r.json", "--mode", "slapo-megatron", "--model", "bert-tiny",
                         "--gpus", "1", "--seq-len", "16", "--batch-size", "2", "--steps", "3",
                         "--warmup", "1", "--profile", prof, "--profile-after", "2")
    assert record.status == "ok", record.reason
    ops = json.loads((prof / "rank0.ops.json").read_text())
    assert ops["steps"] == 2 and ops["ops"]["aten::mm"]["calls"] > 0
    assert "device_us" not in ops  # CPU: no kernel times
    assert len(record.metrics.step_times) == 3 and len(record.metrics.loss) == 3
    notes = record.metrics.extra["notes"]
    assert any("2 more step(s) after the timed ones, which the record's figures leave out" in n
               for n in notes), notes
    assert not any("the timed steps ran slower" in n for n in notes)
    assert record.metrics.extra["profile"]["0"]["top_ops"]
