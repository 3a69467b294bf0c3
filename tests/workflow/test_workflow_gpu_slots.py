"""The file-lock GPU slot allocator: disjoint GPUs for concurrent jobs, no stale locks."""
import json
import signal
import subprocess
import sys

import pytest

from slapo_ae.gpus import visible_ids
from slapo_ae.harness.gpu_slots import GpuSlots, SlotError, main


def test_acquire_is_disjoint_and_released(tmp_path):
    slots = GpuSlots(tmp_path, total=4)
    a = slots.acquire(2)
    b = slots.acquire(2)
    assert sorted(a.slots + b.slots) == [0, 1, 2, 3]
    assert slots.try_acquire(1) is None  # all four taken
    a.release()
    with slots.acquire(2) as c:
        assert set(c.slots) == set(a.slots)
        assert c.visible_devices == ",".join(str(s) for s in c.slots)
    b.release()


def test_maps_slots_to_parent_visible_devices(tmp_path):
    with GpuSlots(tmp_path, total=2, visible="4,6").acquire(2) as alloc:
        assert alloc.visible_devices == "4,6"
    assert visible_ids(None) is None and visible_ids("") == []
    assert visible_ids(" 2, 3,-1,4") == ["2", "3"]  # CUDA stops at -1


def test_impossible_request_and_timeout(tmp_path):
    slots = GpuSlots(tmp_path, total=2)
    with pytest.raises(SlotError):
        slots.acquire(3)
    with pytest.raises(SlotError):
        GpuSlots(tmp_path, total=4, visible="0,1")
    held = slots.acquire(2)
    with pytest.raises(TimeoutError):
        slots.acquire(1, timeout=0.3, poll=0.05)
    held.release()
    assert slots.acquire(0).slots == []


def test_killed_holder_leaves_no_stale_lock(tmp_path):
    code = (f"import sys, time; sys.path[:0] = {sys.path!r}\n"
            "from slapo_ae.harness.gpu_slots import GpuSlots\n"
            f"a = GpuSlots({str(tmp_path)!r}, 2).acquire(2)\n"
            "print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    slots = GpuSlots(tmp_path, total=2)
    assert slots.try_acquire(1) is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with slots.acquire(2, timeout=5) as alloc:
        assert alloc.slots == [0, 1]


def test_concurrent_processes_never_share_a_gpu(tmp_path):
    """Many processes asking for 1-4 of 4 slots at once: at no time do two hold one GPU."""
    trace = tmp_path / "trace.jsonl"
    code = (f"import json, os, sys, time; sys.path[:0] = {sys.path!r}\n"
            "from slapo_ae.harness.gpu_slots import GpuSlots\n"
            "n = int(sys.argv[1])\n"
            f"with GpuSlots({str(tmp_path / 'locks')!r}, 4).acquire(n, poll=0.02) as a:\n"
            "    t0 = time.time(); time.sleep(0.15); t1 = time.time()\n"
            f"    open({str(trace)!r}, 'a').write(json.dumps([t0, t1, a.slots]) + '\\n')\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(n)])
             for n in (1, 2, 4, 3, 1, 2, 2, 1, 4, 1)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(spans) == len(procs)
    for i, (s0, e0, g0) in enumerate(spans):
        for s1, e1, g1 in spans[i + 1:]:
            if s0 < e1 and s1 < e0:  # overlapping in time
                assert not set(g0) & set(g1), (g0, g1)


def test_cli_runs_command_with_visible_devices(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rc = main(["--dir", str(tmp_path), "--total", "3", "--gpus", "2", "--",
               sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"])
    assert rc == 0
    assert capfd.readouterr().out.strip() == "0,1"
