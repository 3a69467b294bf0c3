"""How the harness starts a case's ranks, and what the ranks change in torch before set-up.

- One node: the parent starts every rank itself, with the variables torchrun would give it,
  the ranks meeting through a file store in the launch's own folder; several nodes: one
  torchrun agent per node (:mod:`slapo_ae.harness.launch`).
- ``torch.compile`` on a plain function waits for the function's first call
  (:mod:`slapo_ae.harness.deferred_compile`), so importing megatron-core or DeepSpeed does not
  import TorchDynamo; a called function is compiled and computes as before.
"""
import subprocess
import sys
import textwrap

from harness_util import REPO, env

from slapo_ae.case import Case
from slapo_ae.harness.launch import STORE_ENV, rank_commands
from slapo_ae.harness.runspec import RunSpec


def _spec(tmp_path, **fields) -> RunSpec:
    base = dict(mode="eager", model="bert-tiny", gpus=2, seq_len=16, dec_seq_len=0,
                batch_size=4, batch_expr="4", ckpt=0.0, steps=3, warmup=1)
    spec = RunSpec(case=Case(**{**base, **fields}), out=str(tmp_path / "r.json"),
                   rdzv_endpoint="node0:29400")
    spec.rundir = str(tmp_path)
    return spec


def test_one_node_starts_each_rank_itself_and_several_nodes_start_torchrun(tmp_path):
    started = rank_commands(_spec(tmp_path), {"KEEP": "1"})
    assert len(started) == 2
    for rank, (cmd, rank_env) in enumerate(started):
        assert cmd[1:3] == ["-m", "slapo_ae.harness.worker"] and "torch.distributed.run" not in cmd
        assert {k: rank_env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} \
            == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2"}
        assert rank_env[STORE_ENV] == str(tmp_path / "store") and rank_env["KEEP"] == "1"
    (cmd, agent_env), = rank_commands(_spec(tmp_path, gpus=4, nodes=2), {"KEEP": "1"})
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and STORE_ENV not in agent_env


def test_compile_of_a_function_waits_for_its_first_call():
    script = textwrap.dedent("""
        import torch
        from slapo_ae.harness import deferred_compile
        deferred_compile.install()

        @torch.compile(backend="eager")
        def scaled(x):
            return 2 * x + 1

        module = torch.compile(torch.nn.Linear(2, 2), backend="eager")
        summary = deferred_compile.summary()
        assert summary == {"deferred": 1, "compiled": []}, summary
        assert type(module).__name__ == "OptimizedModule"  # modules are compiled at once
        x = torch.arange(3.0)
        assert torch.equal(scaled(x), 2 * x + 1) and torch.equal(scaled(x), 2 * x + 1)
        assert deferred_compile.summary()["compiled"] == ["__main__.scaled"]
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "ok"


def test_importing_the_engines_imports_no_dynamo():
    script = textwrap.dedent("""
        import sys, torch
        from slapo_ae.harness import deferred_compile
        deferred_compile.install()
        import megatron.core.transformer.transformer_config  # decorates with torch.compile
        print(deferred_compile.summary()["deferred"] > 0, "torch._dynamo" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False"]
