"""The thread budget of a case: cores shared by its ranks, whatever the environment says."""
import pytest

from slapo_ae.case import Case
from slapo_ae.harness.runspec import RunSpec
from slapo_ae.harness.threads import THREAD_ENV_VARS, ThreadBudget, default_cores, thread_env

CASE = Case(mode="eager", model="bert-tiny", gpus=2, seq_len=8, dec_seq_len=0, batch_size=2,
            batch_expr="2", ckpt=None, steps=2, warmup=1, dtype="fp32", device="cpu")


@pytest.mark.parametrize("cores, ranks, per_rank, over", [
    (2, 2, 1, False), (2, 1, 2, False), (16, 2, 8, False), (7, 2, 3, False),
    (1, 2, 1, True), (2, 8, 1, True)])
def test_each_rank_gets_its_share(cores, ranks, per_rank, over):
    budget = ThreadBudget.for_case(cores, ranks)
    assert budget.intra_op == per_rank and budget.inter_op == 1
    assert budget.oversubscribed is over
    assert budget.as_env_record() == {"cores": cores, "ranks": ranks,
                                      "threads_per_rank": per_rank,
                                      "interop_threads_per_rank": 1}


def test_every_pool_gets_the_share():
    env = thread_env(ThreadBudget.for_case(8, 2))
    assert set(env) == set(THREAD_ENV_VARS) and set(env.values()) == {"4"}
    assert "OMP_NUM_THREADS" in env and "MKL_NUM_THREADS" in env


@pytest.mark.parametrize("cores, ranks", [(0, 2), (2, 0)])
def test_nonsense_is_refused(cores, ranks):
    with pytest.raises(ValueError):
        ThreadBudget.for_case(cores, ranks)


def test_the_ranks_environment_overrides_the_callers(monkeypatch):
    from slapo_ae.harness.launch import worker_env

    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what Snakemake exports for a 2-thread job
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "9")
    spec = RunSpec(case=CASE, out="r.json", cores=2)
    env = worker_env(spec)
    assert env["OMP_NUM_THREADS"] == "1" and env["OPENBLAS_NUM_THREADS"] == "1"


def test_a_cpu_case_sees_no_gpu_whatever_the_machine_has(monkeypatch):
    # gpu_check's self-check (--device cpu) on a GPU machine: the ranks must not start CUDA
    import dataclasses

    from slapo_ae.harness.launch import worker_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert worker_env(RunSpec(case=CASE, out="r.json"))["CUDA_VISIBLE_DEVICES"] == ""
    on_gpu = RunSpec(case=dataclasses.replace(CASE, device="cuda"), out="r.json")
    assert worker_env(on_gpu)["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_cpu_rank_stands_for_a_gpu_one_core_each():
    assert default_cores("cpu", 1) == 1 and default_cores("cpu", 4) == 4
    spec = RunSpec(case=CASE, out="r.json")
    assert spec.thread_budget() == ThreadBudget.for_case(2, 2)
