"""Throughput, spread, MFU, peak memory and memory growth (slapo_ae.harness.metrics)."""
import pytest

from slapo_ae.harness.metrics import (
    memory_growth_note,
    memory_in_use_bytes,
    memory_sample_steps,
    mfu,
    peak_flops,
    peak_memory_bytes,
    peak_rss_bytes,
    throughput,
    timed_steps,
)


def test_median_and_spread_exclude_warmup():
    # batch 8; two slow warm-up steps, then steps of 1, 2, 0.5, 1, 4 s
    # per-step samples/s: 8, 4, 16, 8, 2 -> sorted 2, 4, 8, 8, 16; median 8
    out = throughput([30.0, 10.0, 1.0, 2.0, 0.5, 1.0, 4.0], batch_size=8, warmup=2)
    assert out["samples_per_s"] == 8
    spread = out["spread"]
    assert (spread["min"], spread["max"], spread["steps"]) == (2, 16, 5)
    # inclusive quartiles of 2, 4, 8, 8, 16: q1 = 4, q3 = 8
    assert (spread["q1"], spread["q3"], spread["iqr"]) == (4, 8, 4)
    # stdev of (2, 4, 8, 8, 16): mean 7.6, squared deviations 31.36 + 12.96 + 0.16 + 0.16
    # + 70.56 = 115.2, sample variance 115.2 / 4 = 28.8
    assert spread["stdev"] == pytest.approx(28.8**0.5)


def test_even_number_of_steps_and_single_step():
    assert throughput([1.0, 0.5], batch_size=4)["samples_per_s"] == 6  # median of 4 and 8
    one = throughput([9.0, 2.0], batch_size=4, warmup=1)
    assert one["samples_per_s"] == 2 and one["spread"]["stdev"] == 0.0


def test_timed_steps_errors():
    with pytest.raises(ValueError, match="no timed steps"):
        timed_steps([1.0, 1.0], warmup=2)
    with pytest.raises(ValueError, match="positive"):
        timed_steps([1.0, 0.0], warmup=0)
    with pytest.raises(ValueError):
        timed_steps([1.0], warmup=-1)


def test_peak_flops_and_mfu():
    assert peak_flops("Tesla V100-SXM2-32GB") == 125e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 NVL") == peak_flops("NVIDIA H200 NVL") == 835e12
    assert peak_flops("cpu (x86_64)") is None and peak_flops(None) is None
    # the H200 anchors (analysis/gpu_check.py): 430 TFLOPS on an H200 is about 43% of its peak
    assert mfu(430.0, "NVIDIA H200") == pytest.approx(0.435, abs=1e-3)
    assert mfu(430.0, "cpu (x86_64)") is None
    assert mfu(None, "NVIDIA H200") is None


def test_peak_memory_on_cpu_is_peak_rss():
    rss = peak_rss_bytes()
    assert rss > 10 * 2**20  # a Python process with pytest loaded uses more than 10 MiB
    assert peak_memory_bytes("cpu") >= rss


def test_memory_in_use_on_cpu_is_the_resident_set():
    import mmap

    before = memory_in_use_bytes("cpu")
    # 64 MiB of fresh pages, touched: a tensor's could reuse heap pages that an earlier test
    # freed and that stayed resident (CI, 2026-12-05: the resident set did not move)
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = memory_in_use_bytes("cpu")
    block.close()
    assert before > 10 * 2**20 and after - before >= 60 * 2**20


def test_memory_is_sampled_at_the_first_the_middle_and_after_the_last_timed_step():
    assert memory_sample_steps(28, 4) == [4, 16, 28]
    assert memory_sample_steps(3, 1) == [1, 2, 3]
    assert memory_sample_steps(2, 1) == [1, 1, 2]  # one timed step: no halves


def test_memory_growth_note_names_a_leak_in_both_halves_only():
    mib = 2**20
    at = [4, 16, 28]
    # the overlap node's leak of 2026-12-02: about 10 MiB a step on t5-tiny, 24 timed steps
    leak = [[430 * mib, 550 * mib, 679 * mib], [428 * mib, 546 * mib, 670 * mib]]
    note = memory_growth_note(leak, at)
    assert note.startswith("memory grew 249 MiB over the 24 timed steps on rank 0 "
                           "(10.4 MiB a step, in both halves)")
    # the allocator's warm-up: 49 MiB in the first half, flat after
    assert memory_growth_note([[400 * mib, 447 * mib, 449 * mib]], at) is None
    assert memory_growth_note([[400 * mib, 405 * mib, 396 * mib]], at) is None  # jitter
    assert memory_growth_note([[400 * mib, 420 * mib, 440 * mib]], [4, 34, 64]) is None  # slow
    assert memory_growth_note([None, [1, 2, None]], at) is None  # not measured
    assert memory_growth_note([[0, 100 * mib, 200 * mib]], [1, 1, 2]) is None  # no halves
