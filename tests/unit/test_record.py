"""The result record (slapo_ae.record): round trip, atomic write, validation, DataFrame."""
import json
import os

import pytest

from slapo_ae.case import Case
from slapo_ae.record import (
    STATUSES,
    Metrics,
    Record,
    RecordError,
    collect_env,
    read_record,
    write_record,
)

CASE = Case("slapo-megatron", "bert-xlarge", 2, 512, 0, 56, "56", 0.0, source="e2e.cfg", line=7)


def make_record(**kw):
    metrics = Metrics(samples_per_s=12.5, spread={"min": 12.0, "max": 13.0, "steps": 3},
                      flops_per_sample=1.1e12, tflops_per_gpu=6.9, mfu=None,
                      peak_mem_bytes=[100, 120], params=[5, 5], loss=[10.5, 10.25, float("nan")],
                      step_times=[2.0, 1.0, 1.0], warmup_steps=1)
    fields = dict(status="ok", case=CASE, metrics=metrics, env={"torch": "2.13.0"},
                  log_path="logs/x.log", started_at="2026-01-01T00:00:00+00:00")
    fields.update(kw)
    return Record(**fields)


def test_round_trip(tmp_path):
    record = make_record()
    assert record.case["id"] == CASE.id == record.id
    path = write_record(record, tmp_path / "results" / f"{record.id}.json")
    back = read_record(path)
    assert back.case == record.case == CASE.to_record()
    assert back.metrics.loss[:2] == [10.5, 10.25] and back.metrics.loss[2] != back.metrics.loss[2]
    back.metrics.loss = record.metrics.loss = []
    assert back == record
    assert not [p for p in path.parent.iterdir() if p.name != path.name]


def test_failures_are_data(tmp_path):
    for status in STATUSES:
        record = make_record(status=status, reason=f"{status} because", metrics=Metrics())
        assert read_record(write_record(record, tmp_path / f"{status}.json")).status == status
    with pytest.raises(RecordError, match="status"):
        make_record(status="crashed")


def test_interrupted_write_keeps_the_old_file(tmp_path):
    path = write_record(make_record(), tmp_path / "case.json")
    before = path.read_bytes()

    class Unserializable:
        pass

    # serialization fails midway: the metrics block is already partly written when it hits this
    broken = make_record(metrics=Metrics(samples_per_s=1.0, extra={"bad": Unserializable()}))
    with pytest.raises(TypeError):
        write_record(broken, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["case.json"]  # no temp file left behind


def test_numpy_like_scalars_are_serialized(tmp_path):
    torch = pytest.importorskip("torch")
    record = make_record(metrics=Metrics(samples_per_s=torch.tensor(3.5),
                                         loss=torch.tensor([1.0, 2.0])))
    back = read_record(write_record(record, tmp_path / "t.json"))
    assert back.metrics.samples_per_s == 3.5 and back.metrics.loss == [1.0, 2.0]


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "cannot read"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"status": "ok", "case": {}, "metrics": {}}), "lacks reason, env"),
        (json.dumps({"status": "meh", "reason": "", "case": {}, "metrics": {}, "env": {}}),
         "status must be one of"),
        (json.dumps({"status": "ok", "reason": "", "case": [], "metrics": {}, "env": {}}),
         "must be objects"),
    ],
)
def test_read_record_validates(tmp_path, content, says):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(RecordError) as err:
        read_record(path)
    assert str(err.value).startswith(str(path)) and says in str(err.value)


def test_unknown_metrics_are_kept_in_extra(tmp_path):
    data = make_record().to_dict()
    data["metrics"]["tokens_per_s"] = 99.0
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert read_record(path).metrics.extra == {"tokens_per_s": 99.0}


def test_collect_env_has_versions_and_host():
    env = collect_env(device={"device_name": "cpu (test)", "device_count": 0})
    for key in ("torch", "transformers", "deepspeed", "megatron_core", "slapo", "git_commit",
                "hostname", "python", "device_name", "device_count"):
        assert key in env
    assert env["python"].startswith("3.")
    assert env["device_name"] == "cpu (test)"
    assert "cpu_model" in env and env["cpu_count"] >= 1


def test_the_device_names_its_cuda_and_cudnn_versions():
    """Which of SDPA's attention kernels PyTorch prefers depends on the cuDNN it loaded: the
    record says which (None without CUDA, as here)."""
    from slapo_ae.harness.metrics import device_info

    info = device_info()
    assert set(info) == {"device_name", "device_count", "cuda", "cudnn"}
    assert (info["cuda"], info["cudnn"]) == (None, None) or info["device_count"] > 0


def test_the_cpu_model_comes_from_the_kernel_else_the_platform(tmp_path, monkeypatch):
    from slapo_ae.record import cpu_model

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                    "model name\t: AMD EPYC  7B13 64-Core Processor\nprocessor\t: 1\n")
    assert cpu_model(info) == "AMD EPYC 7B13 64-Core Processor"
    monkeypatch.setattr("platform.processor", lambda: "arm")
    assert cpu_model(tmp_path / "missing") == "arm"
    info.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # no model name (ARM)
    assert cpu_model(info) == "arm"
    monkeypatch.setattr("platform.processor", lambda: "")
    assert cpu_model(tmp_path / "missing") is None


def test_files_are_written_atomically_and_readable_by_others(tmp_path):
    """0666 less the umask, as open() gives, not mkstemp's 0600: results written as root on a
    mounted folder stay readable; a writer that fails leaves the old file and no temp file."""
    from slapo_ae import atomic

    old = os.umask(0o022)
    try:
        path = write_record(make_record(), tmp_path / "r.json")
        assert path.stat().st_mode & 0o777 == 0o644
        with pytest.raises(RuntimeError), atomic.replacing(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("the writer broke")
        assert read_record(path).status == "ok"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    finally:
        os.umask(old)


def test_the_commit_is_the_projects_own_or_none(tmp_path, monkeypatch):
    """A copy of the tree inside another repository (as a GPU machine received it) must not
    record that repository's commit; the commit it was copied from can be given instead, and
    the source hash names the code either way."""
    import shutil
    import subprocess

    from slapo_ae import paths

    if shutil.which("git") is None:  # the Docker image has none
        pytest.skip("git is not installed")
    from slapo_ae.record import ENV_COMMIT, git_commit, source_hash

    monkeypatch.delenv(ENV_COMMIT, raising=False)
    outer = tmp_path / "outer"
    tree = outer / "copy"
    for package in ("slapo", "slapo_ae"):
        shutil.copytree(paths.ROOT / package, tree / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    subprocess.run([*git, "-C", str(outer), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-qm", "other"], check=True)
    assert git_commit(tree) is None  # the outer repository's HEAD is not the project's
    head = subprocess.run(["git", "-C", str(outer), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert git_commit(outer) == head  # the top of a checkout: its own commit
    monkeypatch.setenv(ENV_COMMIT, "d37561b")
    assert git_commit(tree) == "d37561b"
    digest = source_hash(tree)
    assert digest.startswith("sha256:") and digest == source_hash(tree)
    (tree / "slapo" / "__init__.py").write_text("# changed\n")
    source_hash.cache_clear()
    assert source_hash(tree) != digest


def test_collect_env_names_the_sources():
    env = collect_env(device={"device_name": "cpu (test)", "device_count": 0})
    assert env["source_hash"].startswith("sha256:")
