"""A case on several nodes: one torchrun agent per node, meeting at a c10d rendezvous.

Two "nodes" on localhost: the same ``slapo-bench run --nodes 2 --rdzv-endpoint ...`` twice at
once, as each machine of a cluster would run it, each with its own record path (nodes without
a shared file system). The node that hosts rank 0 writes the record; the other says so and
writes nothing. (With a shared file system both see the record: it carries the launch's id.)
"""
import subprocess
import sys

import pytest
from harness_util import REPO, env

from slapo_ae.case import Case, CaseError
from slapo_ae.harness.launch import free_port, torchrun_command
from slapo_ae.harness.runspec import RunSpec
from slapo_ae.record import read_record


def _case(**fields) -> Case:
    base = dict(mode="eager", model="bert-tiny", gpus=4, seq_len=16, dec_seq_len=0,
                batch_size=8, batch_expr="8", ckpt=0.0, steps=3, warmup=1)
    return Case(**{**base, **fields})


def test_nodes_are_part_of_the_case_and_its_encodings():
    one, two = _case(), _case(nodes=2)
    assert two.gpus_per_node == 2 and "__g4__n2__" in two.id and "__n" not in one.id
    assert "nodes" not in one.to_json()  # one-node cases keep their encoding (and their jobs)
    assert Case.from_json(two.to_json()) == two and Case.from_json(one.to_json()) == one
    assert two.to_argv()[-2:] == ["--nodes", "2"] and "--nodes" not in one.to_argv()
    assert {k: two.to_record()[k] for k in ("gpus", "nodes", "gpus_per_node")} == \
        {"gpus": 4, "nodes": 2, "gpus_per_node": 2}
    with pytest.raises(CaseError, match="4 GPUs do not spread evenly over 3 nodes"):
        _case(nodes=3)


def test_torchrun_meets_the_other_nodes_at_the_endpoint():
    spec = RunSpec(case=_case(nodes=2), out="r.json", rdzv_endpoint="node0:29400")
    cmd = torchrun_command(spec)
    at = {flag: cmd[cmd.index(flag) + 1] for flag in ("--nnodes", "--rdzv-backend",
                                                      "--rdzv-endpoint", "--nproc_per_node")}
    assert at == {"--nnodes": "2", "--rdzv-backend": "c10d", "--rdzv-endpoint": "node0:29400",
                  "--nproc_per_node": "2"}
    # the same command on each node gives the same rendezvous (and record) id
    again = RunSpec(case=_case(nodes=2), out="elsewhere.json", rdzv_endpoint="node0:29400")
    assert cmd[cmd.index("--rdzv-id") + 1] == spec.run_id == again.run_id


ZERO3 = "--model", "bert-tiny", "--gpus", "2", "--batch-size", "4"


@pytest.mark.parametrize("mode, case, ends", [
    ("eager", ZERO3, "__g2__n2__s16__b4__c0"),
    # DeepSpeed ZeRO-3 across nodes, as the paper's Figure 8 baseline ran it
    pytest.param("deepspeed", ZERO3, "__g2__n2__s16__b4__c0", marks=pytest.mark.slow),
    pytest.param("slapo-deepspeed", ZERO3, "__g2__n2__s16__b4__c0", marks=pytest.mark.slow),
    # Slapo 3D with one pipeline stage per node (Figure 8's layout: stages across nodes)
    pytest.param("slapo-megatron", ("--model", "llama-tiny", "--gpus", "4", "--pp", "2",
                                    "--tp", "2", "--batch-size", "8"),
                 "__g4__n2__p2__t2__s16__b8__c0", marks=pytest.mark.slow),
])
def test_two_localhost_nodes_train_one_case(tmp_path, mode, case, ends):
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "slapo_ae.harness.cli", "run", "--device", "cpu",
           "--mode", mode, *case, "--nodes", "2",
           "--seq-len", "16", "--steps", "3", "--warmup", "1",
           "--rdzv-endpoint", endpoint, "--timeout", "600"]
    outs = [tmp_path / f"node{i}" / "record.json" for i in range(2)]
    nodes = [subprocess.Popen(cmd + ["--out", str(out)], cwd=REPO, env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for out in outs]
    outputs = [node.communicate(timeout=900) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    written = [out for out in outs if out.exists()]
    assert len(written) == 1, outputs
    quiet = outputs[outs.index(next(o for o in outs if not o.exists()))][0]
    assert "this node's ranks finished; the node of rank 0 writes the record" in quiet
    record = read_record(written[0])
    assert record.status == "ok", record.reason
    gpus = int(case[case.index("--gpus") + 1])
    assert (record.case["nodes"], record.case["gpus_per_node"], record.case["gpus"]) == \
        (2, gpus // 2, gpus)
    assert record.case["id"].endswith(ends)
    assert len(record.metrics.peak_mem_bytes) == gpus  # both nodes' ranks reported
    if mode in ("deepspeed", "slapo-deepspeed"):  # ZeRO-3 partitions over both nodes' ranks
        from slapo_ae.zoo import build_model

        whole = sum(p.numel() for p in build_model("bert-tiny").parameters())
        assert record.metrics.extra["dp_size"] == 2
        assert max(record.metrics.params) < 0.6 * whole < sum(record.metrics.params)
    if mode == "slapo-megatron":
        assert (record.case["pp"], record.case["tp"], record.case["dp"]) == (2, 2, 1)
