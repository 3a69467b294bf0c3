"""The harness CLI without training: ``cases``, usage errors (overrides that break their
rule, files that are not text), cases recorded as unsupported before any rank starts, the exit
status of each record's status, and the parent's verdict on dead ranks (from status files);
and a Ctrl-C at the first moments of a run (slow: it starts ranks, then stops them)."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness_util import REPO, TINY, env, slapo_bench

from slapo_ae.case import Case
from slapo_ae.harness import cli
from slapo_ae.harness.runspec import RunSpec, default_timeout
from slapo_ae.record import read_record


def test_cases_expands_a_shipped_cfg(capsys):
    assert cli.main(["cases", "configs/e2e/single_node_asplos24.cfg", "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert len(found) == 72
    assert len({c["id"] for c in found}) == 72
    first = found[0]
    assert first["id"] == "megatron__bert-xlarge__g2__s512__b20__c0"
    assert first["source"].endswith("single_node_asplos24.cfg") and first["line"] > 0


def test_cases_text_and_pow2(tmp_path, capsys):
    cfg = tmp_path / "pow2.cfg"
    cfg.write_text('slapo-megatron bert-tiny pow2 16 0 "4*n" 0.5\n')
    assert cli.main(["cases", str(cfg), "--max-gpus", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == [
        f"slapo-megatron__bert-tiny__g{n}__s16__b{4 * n}__c0.5" for n in (1, 2, 4)]


def test_cases_malformed_cfg_exits_nonzero_with_file_and_line(tmp_path):
    cfg = tmp_path / "bad.cfg"
    cfg.write_text("# fine comment\n"
                   "eager bert-tiny 2 16 0 4 0\n"
                   "eagre bert-tiny 2 16 0 4 0\n"
                   "deepspeed bert-tiny 2 16 0 \"__import__('os')\" 0\n"
                   "eager no-such-model 2 16 0 4 0\n")
    proc = slapo_bench("cases", cfg)  # the real command line, as a workflow calls it
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert [e.split(": ")[0] for e in errors] == [f"{cfg}:3", f"{cfg}:4", f"{cfg}:5"]
    assert "did you mean eager" in errors[0]
    assert "unknown model 'no-such-model'" in errors[2]
    assert proc.stdout == ""


def test_cases_missing_file(tmp_path, capsys):
    assert cli.main(["cases", str(tmp_path / "nope.cfg")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_run_unknown_model_is_a_clear_usage_error(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--mode", "eager", "--model", "bert-tinyy", *TINY, "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown model 'bert-tinyy'" in err and "Did you mean 'bert-tiny'" in err
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--mode", "eager", "--steps", "2", "--warmup", "2"], "must exceed --warmup"),
    (["--mode", "megatron", "--ckpt", "0.5"], "--ckpt"),
    (["--mode", "eager", "--ckpt", "full"], "--ckpt"),
    (["--mode", "eager", "--batch-size", "n/3"], "--batch-size"),
    (["--mode", "slapo-magatron"], "unknown mode"),
    (["--mode", "eager", "--override", "hidden_sise=64"], "--override"),
    # values the ranks would fail on after the launch: refused here, before it
    (["--mode", "eager", "--override", "hidden_size=abc"],
     "override hidden_size=\"abc\" of bert-tiny: hidden_size must be a positive integer (a "
     "size or count), got 'abc'"),
    (["--mode", "eager", "--timeout", "inf"], "--timeout must be a positive number of seconds"),
    (["--mode", "eager", "--timeout", "nan"], "--timeout must be a positive number of seconds"),
    (["--mode", "eager", "--lr", "nan"], "--lr must be a positive number"),
    (["--mode", "eager", "--lr", "-1"], "--lr must be a positive number"),
    (["--mode", "eager", "--steps", "99999999999999999999"], "--steps must be at most"),
    (["--mode", "eager", "--gpus", "99999999999999999999"], "--gpus must be 1 to 65536"),
    (["--mode", "eager", "--memory-per-rank", "99999999999999999999"],
     "--memory-per-rank must be at most"),
    (["--mode", "eager", "--seq-len", "513"],
     "SEQ_LEN 513 is longer than bert-tiny's 512 positions"),
    (["--mode", "eager", "--seq-len", "1025", "--override", "max_position_embeddings=1024"],
     "SEQ_LEN 1025 is longer than bert-tiny's 1024 positions"),
    (["--mode", "eager", "--profile-after", "2"], "--profile-after needs --profile DIR"),
    (["--mode", "eager", "--profile-after", "-1"], "--profile-after must be at least 0"),
    # found by a probe of bad input, 2026-12-05: each failed after the launch, or trained and
    # then lost its record, or was silently taken
    (["--mode", "eager", "--dec-seq-len", "32"],
     "DEC_SEQ_LEN is T5's decoder length; bert-tiny has no decoder: write 0, got 32"),
    (["--mode", "eager", "--model", "t5-tiny", "--dec-seq-len", "0"],
     "DEC_SEQ_LEN must be the decoder's length (>= 1) for t5-tiny"),
    (["--mode", "eager", "--seed", "99999999999999999999999"], "--seed must be 0 to 2**63 - 1"),
    (["--mode", "eager", "--override", "_slapo=1"], "override _slapo of bert-tiny: the "
     "model's identity"),
    (["--mode", "eager", "--override", 'model_type="gpt2"'], "override model_type of bert-tiny"),
    (["--mode", "eager", "--cores", "1000000"],
     "--cores 1000000: 500000 threads for each of the 2 ranks, more than this machine"),
    (["--mode", "eager", "--out", ""], "--out must name the record's file"),
    (["--mode", "eager", "--gpus", "2", "--nodes", "2", "--rdzv-endpoint", "host:99999"],
     "--rdzv-endpoint 'host:99999': expected HOST:PORT"),
    (["--mode", "eager", "--gpus", "2", "--nodes", "2", "--rdzv-endpoint", "nonsense"],
     "--rdzv-endpoint 'nonsense': expected HOST:PORT"),
])
def test_run_usage_errors(tmp_path, capsys, args, message):
    base = {"--model": "bert-tiny", "--gpus": "2", "--seq-len": "16", "--batch-size": "4",
            "--steps": "3", "--warmup": "1", "--out": str(tmp_path / "r.json")}
    for key, value in zip(args[::2], args[1::2]):
        base[key] = value
    argv = ["run"] + [x for kv in base.items() for x in kv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists()


def test_cpu_ranks_may_hold_more_cores_than_the_machine_has(tmp_path, monkeypatch):
    """A CPU rank stands for a GPU: 2 ranks on a 1-core machine hold 2 cores (the default, as
    the workflow passes it), oversubscribed, and on 2 cores 4 (2 threads each); a rank given
    more threads than the machine has cores is refused."""
    from slapo_ae.harness import threads

    argv = ["run", "--mode", "eager", "--model", "bert-tiny", "--gpus", "2", "--seq-len", "16",
            "--batch-size", "4", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "r")]
    for machine, cores, given in ((1, None, 2), (1, "3", 3), (2, "4", 4), (2, "5", 5)):
        monkeypatch.setattr(threads, "available_cores", lambda n=machine: n)
        extra = [] if cores is None else ["--cores", cores]
        spec = cli.spec_from_args(cli.build_parser().parse_args(argv + extra))
        assert spec.cores == given, (machine, cores)
    monkeypatch.setattr(threads, "available_cores", lambda: 1)
    with pytest.raises(cli.UsageError, match="--cores 4: 2 threads for each of the 2 ranks, "
                                             "more than this machine's 1 cores"):
        cli.spec_from_args(cli.build_parser().parse_args(argv + ["--cores", "4"]))


def test_a_batch_data_parallel_ranks_cannot_split_is_refused_before_launch(tmp_path, capsys):
    argv = ["run", "--mode", "eager", "--model", "bert-tiny", "--gpus", "2", "--seq-len", "16",
            "--batch-size", "3", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "r")]
    assert cli.main(argv) == 2
    assert "--batch-size '3': gives 3 for 2 GPUs, not divisible" in capsys.readouterr().err


def test_ctrl_c_before_the_ranks_start_is_one_line_and_no_record(tmp_path, capsys,
                                                                 monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt  # as a Ctrl-C during the harness's imports would

    monkeypatch.setattr(cli, "spec_from_args", interrupted)
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--mode", "eager", "--model", "bert-tiny", *TINY, "--out", str(out)])
    assert rc == 130
    err = capsys.readouterr().err
    assert err == ("slapo-bench run: interrupted before any rank started; "
                   "no record written\n")
    assert not out.exists()


# -- Ctrl-C from the first moment ---------------------------------------------------------
def _moment_reached(proc, moment: str, out: Path, stderr: list[str]) -> None:
    """Wait until ``proc`` (``python -X importtime -m slapo_ae.harness.cli run``) reaches
    ``moment``: an artifact module imported (importtime prints each import as it ends), the
    log created (the launch begins), or a rank's first line in the log (the ranks run)."""
    if moment.startswith("slapo_ae"):
        for line in proc.stderr:  # the parent's stderr: importtime's lines, in order
            stderr.append(line)
            if line.startswith("import time:") and line.split("|")[-1].strip() == moment:
                return
        raise AssertionError(f"the harness ended before importing {moment}: {stderr[-5:]}")
    log = out.with_suffix(".log")
    for _ in range(1200):  # a bounded wait for the launch, never a timing assertion
        text = log.read_text() if log.exists() else None
        if text is not None and (moment == "log" or "[slapo-bench rank" in text):
            return
        assert proc.poll() is None, "the harness ended before the moment"
        time.sleep(0.1)
    raise AssertionError(f"no {moment} after 120 s")


def _sigint_as_in_a_terminal() -> None:
    """SIGINT at its default in the harness, as a terminal's foreground job has it. A test run
    started in the background by a shell without job control inherits SIGINT ignored, and
    Python keeps an ignored SIGINT until the harness sets its handler: a Ctrl-C before then
    would be lost, and the run would go on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _processes_naming(text: str) -> list[str]:
    found = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if text in (proc_dir / "cmdline").read_bytes().decode(errors="replace"):
                found.append(proc_dir.name)
        except OSError:
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("moment, sig", [
    ("slapo_ae.case", signal.SIGINT),  # argparse's options of the case: the first import
    ("slapo_ae.zoo.configs", signal.SIGINT),  # the case is being checked
    ("slapo_ae.zoo.configs", signal.SIGTERM),  # as the case runner stops an agent
    ("slapo_ae.harness.launch", signal.SIGINT),  # the launcher, just before the case's check
    ("log", signal.SIGINT),  # the launch has begun: the ranks are starting
    ("rank", signal.SIGINT),  # a rank runs (imports torch)
    ("rank", signal.SIGTERM),
])
def test_ctrl_c_in_the_first_moments_is_one_line_and_leaves_no_rank(tmp_path, moment, sig):
    """Interrupted at any moment before its record, ``slapo-bench run`` prints one line (no
    traceback), exits 128 + signal and leaves no rank behind and no record. The moments are
    events of the run, so that a loaded machine reaches each of them, only later."""
    out = tmp_path / "r.json"
    # steps enough that no run finishes between its first rank's line and the signal (with
    # TINY's 3 steps one did, on a loaded machine, and wrote its record: CI, 2026-12-05)
    long_run = [*TINY[:TINY.index("--steps")], "--steps", "100000", "--warmup", "1"]
    cmd = [sys.executable, "-X", "importtime", "-m", "slapo_ae.harness.cli", "run",
           "--device", "cpu", "--mode", "eager", "--model", "bert-tiny", *long_run,
           "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_in_a_terminal)
    stderr: list[str] = []
    try:
        _moment_reached(proc, moment, out, stderr)
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=300)
    finally:
        proc.kill()
    lines = [line for line in "".join(stderr).splitlines() + rest.splitlines()
             if not line.startswith("import time:")]
    assert proc.returncode == 128 + sig, lines
    assert len(lines) == 1 and lines[0].startswith("slapo-bench run: interrupted"), lines
    assert lines[0].endswith("; no record written")
    if moment.startswith("slapo_ae") and moment != "slapo_ae.harness.launch":
        assert lines[0] == ("slapo-bench run: interrupted before any rank started; "
                            "no record written")
    if moment == "rank":
        assert "; its ranks were stopped;" in lines[0]
    assert not out.exists()
    for _ in range(300):  # the ranks name the record in their --spec
        if not _processes_naming(str(out)):
            break
        time.sleep(0.1)
    assert not _processes_naming(str(out))


def test_an_interruption_after_the_record_says_it_was_kept(tmp_path, capsys):
    from slapo_ae.record import write_record

    spec = _spec(tmp_path)
    write_record(spec.non_ok_record("unsupported", "a reason"), spec.out)
    assert cli.interrupted("slapo-bench run", signal.SIGINT, spec) == 130
    assert capsys.readouterr().err == (f"slapo-bench run: interrupted; its record {spec.out} "
                                       "was written before\n")


# -- exit status ---------------------------------------------------------------------------
@pytest.mark.parametrize("status, code", [("ok", 0), ("failed", 3), ("oom", 4),
                                          ("unsupported", 5)])
def test_the_exit_status_says_the_records_status(tmp_path, monkeypatch, status, code):
    from slapo_ae.harness import launch
    from slapo_ae.record import Record, write_record

    def run(spec):
        record = Record(status=status, case=spec.case_dict(), reason="" if status == "ok"
                        else "why", metrics={"samples_per_s": 1.0 if status == "ok" else None})
        write_record(record, spec.out)
        return record

    monkeypatch.setattr(launch, "run", run)
    out = tmp_path / "r.json"
    assert cli.main(["run", "--mode", "eager", "--model", "bert-tiny", *TINY, "--device", "cpu",
                     "--out", str(out), "--quiet"]) == code
    assert read_record(out).status == status


def test_an_unsupported_case_exits_5_from_the_command_line(tmp_path):
    proc = slapo_bench("run", "--device", "cpu", "--mode", "torchscript", "--model", "bert-tiny",
                       *TINY, "--out", tmp_path / "r.json")
    assert proc.returncode == 5 and read_record(tmp_path / "r.json").status == "unsupported"
    assert proc.stderr == ""


# -- model-config overrides ----------------------------------------------------------------
@pytest.mark.parametrize("model, override, message", [
    ("bert-tiny", "num_hidden_layers=0", "override num_hidden_layers=0 of bert-tiny: "
     "num_hidden_layers must be a positive integer (a size or count), got 0"),
    ("bert-tiny", "num_hidden_layers=-1", "override num_hidden_layers=-1 of bert-tiny: "
     "num_hidden_layers must be a positive integer (a size or count), got -1"),
    ("bert-tiny", "hidden_size=-64", "override hidden_size=-64 of bert-tiny: hidden_size must "
     "be a positive integer (a size or count), got -64"),
    ("bert-tiny", "vocab_size=-5", "override vocab_size=-5 of bert-tiny: vocab_size must be a "
     "positive integer (a size or count), got -5"),
    ("bert-tiny", "num_attention_heads=0", "override num_attention_heads=0 of bert-tiny: "
     "num_attention_heads must be a positive integer (a size or count), got 0"),
    ("bert-tiny", "hidden_dropout_prob=2", "override hidden_dropout_prob=2 of bert-tiny: "
     "hidden_dropout_prob must be a probability in [0, 1], got 2"),
    ("bert-tiny", "hidden_size=130", "override hidden_size=130 of bert-tiny: "
     "num_attention_heads 4 does not divide hidden_size 130 (each head takes hidden_size / "
     "num_attention_heads)"),
    ("bert-tiny", "vocab_size=0.5", "override vocab_size=0.5 of bert-tiny: vocab_size must be "
     "a positive integer (a size or count), got 0.5"),
    ("bert-tiny", 'hidden_act="nope"', "--override: bert-tiny: hidden_act 'nope' names no "
     "activation transformers knows"),
    # aliases: T5's num_hidden_layers is its num_layers
    ("t5-tiny", "num_hidden_layers=0", "override num_hidden_layers=0 of t5-tiny: num_layers "
     "must be a positive integer (a size or count), got 0"),
    ("gpt-neo-tiny", "num_layers=3", "override num_layers=3 of gpt-neo-tiny: num_layers 3 is "
     "not the 2 layers attention_types names (one kind of attention per layer)"),
    ("llama-tiny", "num_key_value_heads=3", "override num_key_value_heads=3 of llama-tiny: "
     "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ("opt-tiny", "layerdrop=1.5", "override layerdrop=1.5 of opt-tiny: layerdrop must be a "
     "probability in [0, 1], got 1.5"),
    ("wideresnet-tiny", "layers=[1, 0, 1, 1]", "override layers=[1, 0, 1, 1] of "
     "wideresnet-tiny: layers must be a non-empty list of positive integers"),
])
def test_overrides_that_make_no_model_are_refused_before_anything_runs(tmp_path, capsys, model,
                                                                       override, message):
    out = tmp_path / "r.json"
    argv = ["run", "--mode", "eager", "--model", model, "--gpus", "1", "--seq-len", "16",
            "--dec-seq-len", "8" if model.startswith("t5") else "0", "--batch-size", "2",
            "--steps", "2", "--warmup", "1", "--device", "cpu", "--out", str(out),
            "--override", override]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slapo-bench run: error: {message}") and len(err.splitlines()) == 1
    assert not out.exists() and not out.with_suffix(".log").exists()


# -- files that are not text ---------------------------------------------------------------
def test_cases_refuses_a_file_that_is_not_text_in_one_line(tmp_path):
    cfg = tmp_path / "random.cfg"
    cfg.write_bytes(b"eager bert-tiny 1 16 0 2 0\n" + bytes(range(128, 256)) * 24)
    proc = slapo_bench("cases", cfg)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"{cfg}: not UTF-8 text: byte 0x80 at offset 27 cannot be decoded "
                           "(invalid start byte)\n")


def test_the_data_parallel_modes_are_the_systems_that_split_the_batch():
    """``case.DATA_PARALLEL_MODES`` (checked when a cfg is parsed) names exactly the systems
    whose ranks each take a slice of the batch; the ranks refuse an uneven split as well."""
    import torch

    from slapo_ae.case import DATA_PARALLEL_MODES, MODES
    from slapo_ae.harness.systems import Unsupported, get_system
    from slapo_ae.harness.systems.base import DistContext

    ctx = DistContext(0, 2, 0, torch.device("cpu"))
    for mode in set(MODES) - {"torchscript"}:
        system = get_system(mode)(_spec(mode=mode), ctx)
        assert (system.dp_size == 2) == (mode in DATA_PARALLEL_MODES), mode
    uneven = get_system("eager")(_spec(mode="eager", batch_size=3), ctx)
    with pytest.raises(Unsupported, match="global batch 3 is not divisible by 2"):
        uneven.micro_batch()


def test_run_refuses_result_paths_it_cannot_write_before_running(tmp_path, capsys):
    """An unwritable --out, --log or --profile is a usage error at once, not a result lost
    after the case has trained."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    base = ["run", "--mode", "eager", "--model", "bert-tiny", *TINY]
    for flag, where in (("--out", "/proc/no-such-dir/r.json"), ("--log", blocker / "x.log"),
                        ("--profile", blocker / "profiles")):
        out = ["--out", str(tmp_path / "r.json")] if flag != "--out" else []
        assert cli.main([*base, *out, flag, str(where)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"slapo-bench run: error: {flag}: cannot create"), err
        assert "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_run_refuses_two_outputs_in_one_place_before_running(tmp_path, capsys):
    """--out and --profile (or --log) naming one path: the case trained, then its record could
    not replace the profile's folder and was lost (a probe of bad input, 2026-12-05)."""
    base = ["run", "--mode", "eager", "--model", "bert-tiny", *TINY]
    same = str(tmp_path / "p")
    for extra in (["--out", same, "--profile", same], ["--out", same, "--log", same],
                  ["--out", str(tmp_path / "r.log")]):
        assert cli.main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert "name the same place" in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())
    twice = ["--override", "hidden_size=64", "--override", "hidden_size=32"]
    assert cli.main([*base, "--out", str(tmp_path / "r.json"), *twice]) == 2
    assert "--override hidden_size is given twice (64, 32)" in capsys.readouterr().err


def test_run_refuses_a_folder_as_its_record_or_log_before_running(tmp_path, capsys):
    """An --out or --log that names a folder could never be replaced by the file: a usage
    error at once (it was a traceback and no record, after the case had trained)."""
    folder = tmp_path / "a-folder"
    folder.mkdir()
    base = ["run", "--mode", "eager", "--model", "bert-tiny", *TINY]
    for flag in ("--out", "--log"):
        out = ["--out", str(tmp_path / "r.json")] if flag != "--out" else []
        assert cli.main([*base, *out, flag, str(folder)]) == 2
        err = capsys.readouterr().err
        assert err == f"slapo-bench run: error: {flag}: {folder} is a folder, not a file\n"
    assert not (tmp_path / "r.json").exists() and not list(folder.iterdir())


@pytest.mark.parametrize("mode, model, extra, reason", [
    ("torchscript", "bert-tiny", [], "torchscript mode"),
    ("megatron", "roberta-tiny", [], "Megatron-LM has no RoBERTa"),
    ("megatron", "opt-tiny", [], "Megatron-LM has no OPT"),
    ("megatron", "wideresnet-tiny", [], "Megatron-LM has no WideResNet"),
    ("eager", "bert-tiny", ["--dtype", "fp16"], "fp16 on CPU"),
    ("slapo-deepspeed", "bert-tiny", ["--dtype", "bf16"], "bf16 on CPU"),
    # no machine here holds 4096 CPU ranks: refused before torchrun starts one
    ("slapo-megatron", "bert-tiny", ["--gpus", "4096"], "needs 4096 CPU ranks; this machine "
                                                        "holds at most"),
])
def test_unsupported_is_recorded_without_launching(tmp_path, capsys, mode, model, extra, reason):
    out = tmp_path / "r.json"
    rc = cli.main(["run", "--mode", mode, "--model", model, *TINY, "--device", "cpu",
                   "--out", str(out), "--case-id", "my-id", *extra])
    assert rc == cli.EXIT_STATUS["unsupported"] == 5
    record = read_record(out)
    assert record.status == "unsupported" and reason in record.reason
    assert record.id == "my-id"
    assert record.metrics.samples_per_s is None and record.metrics.loss == []
    assert record.env["torch"] and record.log_path == str(out.with_suffix(".log"))
    assert "not launched" in out.with_suffix(".log").read_text()
    assert f"my-id: unsupported: {reason}" in capsys.readouterr().out


def test_family_without_schedule_is_unsupported(monkeypatch):
    """schedule_model's NotImplementedError (a family with no schedule) -> Unsupported."""
    import torch

    import slapo.model_schedule as model_schedule
    from slapo_ae.harness.systems import Unsupported
    from slapo_ae.harness.systems.base import DistContext
    from slapo_ae.harness.systems.slapo_tp import scheduled_model

    monkeypatch.setattr(model_schedule, "FAMILIES", ())
    spec = _spec(mode="slapo-megatron")
    with pytest.raises(Unsupported, match="no Slapo schedule: no schedule for BertForMaskedLM "
                                          r"\(model type 'bert'\)"):
        scheduled_model(spec, DistContext(0, 1, 0, torch.device("cpu")), [],
                        tensor_parallel=True, shard_embedding=True, kernel_opt=True)


def test_default_timeouts():
    assert default_timeout("cuda", 40) == 1800
    assert default_timeout("cpu", 6) == 600 + 120 * 6


# -- the parent's verdict when rank 0 wrote no record -------------------------------------
def _spec(tmp_path=None, mode="eager", batch_size=4, **fields):
    case = Case(mode=mode, model="bert-tiny", gpus=2, seq_len=16, dec_seq_len=0,
                batch_size=batch_size, batch_expr=str(batch_size), ckpt=0.0, steps=3, warmup=1,
                dtype="fp32", device="cpu")
    base = dict(case=case, out=str(Path(tmp_path or "/nonexistent") / "r.json"), log=None,
                timeout=30.0, run_id="run-1", launch_time=0.0)
    base.update(fields)
    return RunSpec(**base)


def _rank_file(rundir, rank, status, reason, t, traceback=""):
    (rundir / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "status": status, "reason": reason, "time": t, "traceback": traceback}))


def test_conclude_prefers_oom_and_keeps_the_traceback(tmp_path):
    from slapo_ae.harness.launch import conclude

    log = tmp_path / "r.log"
    log.write_text("[slapo-bench rank 0] step 1/3: 0.1 s (warm-up)\nlast line of the log\n")
    spec = _spec(tmp_path, log=str(log))
    _rank_file(tmp_path, 0, "failed", "rank 0: RuntimeError: gloo peer died", 2.0)
    _rank_file(tmp_path, 1, "oom", "rank 1: OutOfMemoryError: CUDA out of memory", 1.0,
               "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory")
    record = conclude(spec, 1, False, tmp_path)
    assert record.status == "oom"
    head, *rest = record.reason.splitlines()
    assert head == "out of memory: rank 1: OutOfMemoryError: CUDA out of memory"
    assert "--- rank 1 traceback ---" in rest and "last line of the log" in rest
    assert record.metrics.extra["rank_status"] == {"0": "failed", "1": "oom"}


def test_conclude_failed_timeout_and_silent_death(tmp_path):
    from slapo_ae.harness.launch import conclude

    log = tmp_path / "r.log"
    log.write_text("[slapo-bench rank 0] step 2/3: 0.1 s\n")
    spec = _spec(tmp_path, log=str(log))
    record = conclude(spec, None, True, tmp_path)
    assert record.status == "failed"
    assert record.reason.startswith("timeout: killed after 30 s")
    assert "last progress: [slapo-bench rank 0] step 2/3" in record.reason.splitlines()[0]

    record = conclude(spec, -9, False, tmp_path)
    assert record.status == "failed"
    assert record.reason.splitlines()[0] == (
        "a rank was killed by SIGKILL before a record was written")

    _rank_file(tmp_path, 1, "failed", "rank 1: ValueError: bad", 1.0, "Traceback\nValueError: bad")
    record = conclude(spec, 1, False, tmp_path)
    assert record.reason.splitlines()[0] == "rank 1: ValueError: bad (a rank exited with code 1)"


def test_fault_injection_parsing(monkeypatch):
    from slapo_ae.harness import worker

    monkeypatch.setenv(worker.FAULT_ENV, "hang@1")
    assert worker.injected_fault(1, "step") == "hang"
    assert worker.injected_fault(0, "step") is None
    assert worker.injected_fault(1, "setup") is None
    monkeypatch.setenv(worker.FAULT_ENV, "oom:setup")
    assert worker.injected_fault(0, "setup") == worker.injected_fault(1, "setup") == "oom"
    assert worker.injected_fault(0, "step") is None
    monkeypatch.delenv(worker.FAULT_ENV)
    assert worker.injected_fault(0, "step") is None


def test_a_bug_in_the_harness_itself_still_leaves_a_failed_record(tmp_path, monkeypatch, capsys):
    from slapo_ae.harness import launch

    def broken(spec):
        raise KeyError("a bug")

    monkeypatch.setattr(launch, "run", broken)
    out = tmp_path / "r.json"
    assert cli.main(["run", "--mode", "eager", "--model", "bert-tiny", *TINY, "--device", "cpu",
                     "--out", str(out)]) == cli.EXIT_STATUS["failed"]
    record = read_record(out)
    assert record.status == "failed"
    assert record.reason.startswith("harness error: KeyError: 'a bug'")
    assert "Traceback" in record.reason


def test_a_rank_the_oom_killer_ended_is_recorded_as_oom(tmp_path):
    """No status file, a rank failed, and the kernel's OOM-kill count rose: ``oom``."""
    from slapo_ae.harness.launch import conclude

    spec = _spec(tmp_path, log=str(tmp_path / "r.log"))
    record = conclude(spec, 1, False, tmp_path, oom_killed=(3, 4))
    assert record.status == "oom"
    assert record.reason.startswith("out of memory: the kernel's OOM killer ended a process")
    assert conclude(spec, 1, False, tmp_path).status == "failed"


def test_a_loss_that_is_not_finite_fails_the_case(tmp_path, capsys):
    """A learning rate of 1e4 (for 1e-4) diverged to NaN and was recorded ok, its samples/s
    a result (a probe of bad input, 2026-12-05): the record now fails, saying from which step."""
    out = tmp_path / "r.json"
    argv = ["run", "--mode", "eager", "--model", "bert-tiny", "--gpus", "1", "--seq-len", "16",
            "--batch-size", "4", "--steps", "4", "--warmup", "1", "--lr", "1e4",
            "--device", "cpu", "--out", str(out)]
    assert cli.main(argv) == 3
    record = read_record(out)
    assert record.status == "failed" and record.reason.startswith("the loss is not finite from")
    assert not all(math.isfinite(x) for x in record.metrics.loss)
