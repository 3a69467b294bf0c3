"""`--resources gpus=8` packs cases onto one node without oversubscription, and concurrent
cases get disjoint CUDA_VISIBLE_DEVICES (fake harness on a pretend 8-GPU machine)."""
import itertools

import pytest
from wf_util import make_config

from slapo_ae.record import read_record

pytestmark = pytest.mark.slow

CFG = """\
deepspeed       bert-tiny 8   64 0 8*n 0
slapo-deepspeed bert-tiny 4   64 0 8*n 0
deepspeed       bert-tiny 4   64 0 8*n 0
slapo-megatron  bert-tiny 2,4 64 0 2*n 0
megatron        bert-tiny 2   64 0 2*n 0
eager           bert-tiny 1   64 0 2   0
slapo-kernel    bert-tiny 1   64 0 2   0
deepspeed       bert-tiny 16  64 0 16  0
"""


def test_cases_pack_onto_eight_gpus(repo):
    (repo.path / "configs" / "e2e" / "pack.cfg").write_text(CFG)
    config = make_config(repo.path, device="cuda", max_gpus=8,
                         experiments={"e2e": ["configs/e2e/pack.cfg"], "ablation": []})
    config["gpus"] = 8
    repo.write_config(config)
    repo.plan({"*": {"sleep": 1.5}})
    repo.snakemake("results/e2e.csv", "--cores", "8", "--resources", "gpus=8")

    trace = repo.trace()
    assert len(trace) == 8  # the 16-GPU case never ran ...
    big = read_record(repo.record("e2e", "deepspeed__bert-tiny__g16__s64__b16__c0"))
    assert big.status == "unsupported"  # ... it is recorded as unsupported

    for job in trace:
        devices = job["cuda_visible_devices"].split(",")
        assert len(devices) == job["gpus"] and len(set(devices)) == job["gpus"]
        assert set(devices) <= {str(i) for i in range(8)}
    overlapping = 0
    for a, b in itertools.combinations(trace, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            overlapping += 1
            assert not set(a["cuda_visible_devices"].split(",")) & \
                set(b["cuda_visible_devices"].split(","))
    # at every job start, the GPUs in use add up to at most 8
    for job in trace:
        t = job["start"] + 1e-3
        assert sum(j["gpus"] for j in trace if j["start"] <= t < j["end"]) <= 8
    assert overlapping >= 2  # cases did share the node
