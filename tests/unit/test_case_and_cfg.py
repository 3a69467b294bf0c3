"""The cfg format (slapo_ae.cfg) and the case model with its one encoding (slapo_ae.case)."""
import argparse
import dataclasses
import json

import pytest

from slapo_ae.case import Case, CaseError, add_arguments, from_args, safe_name
from slapo_ae.cfg import CfgError, expand_gpus, parse_cfg, parse_cfg_text, to_cfg_line
from slapo_ae.zoo.configs import list_models

SAMPLE = """\
# a comment line, then a blank line

megatron bert-large-uncased 2,4,8 512 0 "min(8*n, 48)" full
slapo-megatron EleutherAI/gpt-neo-2.7B pow2 1024 0 "8 * int(math.log2(n) + 1)" 0.5  # trailing
   # an indented comment
deepspeed t5-3b 2 1024 512 '16 if n<=2 else 10*n' 1
slapo-deepspeed facebook/opt-2.7b 4 1024 0 16*n 0
megatron bert-large-uncased 1 512 0 4 0
eager bert-xlarge 1 512 0 12 0
"""


def write(tmp_path, text, name="sample.cfg"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_sample_file(tmp_path):
    path = write(tmp_path, SAMPLE)
    cases = parse_cfg(path, max_gpus=4)
    got = [(c.mode, c.model, c.gpus, c.batch_size, c.ckpt, c.line) for c in cases]
    assert got == [
        ("megatron", "bert-large-uncased", 2, 16, "full", 3),
        ("megatron", "bert-large-uncased", 4, 32, "full", 3),
        ("megatron", "bert-large-uncased", 8, 48, "full", 3),
        ("slapo-megatron", "EleutherAI/gpt-neo-2.7B", 1, 8, 0.5, 4),
        ("slapo-megatron", "EleutherAI/gpt-neo-2.7B", 2, 16, 0.5, 4),
        ("slapo-megatron", "EleutherAI/gpt-neo-2.7B", 4, 24, 0.5, 4),
        ("deepspeed", "t5-3b", 2, 16, 1.0, 6),
        ("slapo-deepspeed", "facebook/opt-2.7b", 4, 64, 0.0, 7),
        ("megatron", "bert-large-uncased", 1, 4, None, 8),
        ("eager", "bert-xlarge", 1, 12, 0.0, 9),
    ]
    t5 = cases[6]
    assert (t5.seq_len, t5.dec_seq_len, t5.batch_expr) == (1024, 512, "16 if n<=2 else 10*n")
    assert t5.source == str(path) and t5.where == f"{path}:6"


def test_ids_are_readable_and_filesystem_safe():
    case = Case("slapo-megatron", "bert-xlarge", 2, 512, 0, 56, "56", 0.0)
    assert case.id == "slapo-megatron__bert-xlarge__g2__s512__b56__c0"
    gpt = Case("deepspeed", "EleutherAI/gpt-neo-2.7B", 8, 1024, 0, 48, "48", 1.0)
    assert gpt.id == "deepspeed__EleutherAI--gpt-neo-2.7B__g8__s1024__b48__c1"
    t5 = Case("megatron", "t5-3b", 2, 1024, 512, 4, "4", "full")
    assert t5.id == "megatron__t5-3b__g2__s1024__d512__b4__cfull"
    assert Case("megatron", "m", 2, 8, 0, 4, "4", None).id.endswith("__c0")
    assert Case("slapo-deepspeed", "m", 2, 8, 0, 4, "4", 0.67).id.endswith("__c0.67")
    assert safe_name("a/b c:d") == "a--b_c_d"


def test_case_is_frozen_and_its_record_names_where_it_was_written():
    case = parse_cfg_text("deepspeed t5-3b 2 1024 512 '2*n' 1", "x.cfg")[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        case.gpus = 4
    data = case.to_record()
    assert data == {"id": case.id, "mode": "deepspeed", "model": "t5-3b", "gpus": 2,
                    "nodes": 1, "gpus_per_node": 2, "pp": 1, "tp": 1, "dp": 2,
                    "micro_batch": 2, "seq_len": 1024, "dec_seq_len": 512,
                    "batch_size": 4, "batch_expr": "2*n",
                    "ckpt": 1.0, "source": "x.cfg", "line": 1}
    assert case.to_record("other")["id"] == "other"


def run_parser():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


@pytest.mark.parametrize("line", ["megatron t5-tiny 2 64 32 '2*n' selective",
                                  "megatron bert-tiny 1 64 0 4 0",
                                  "slapo-deepspeed opt-tiny 2 128 0 8 0.5"])
def test_one_encoding_json_and_argv_round_trip(line):
    case = parse_cfg_text(line, "x.cfg")[0]
    job = case.for_run(steps=6, warmup=2, dtype="fp32", device="cpu")
    assert job.batch_expr == str(case.batch_size) and (job.source, job.line) == ("", 0)
    assert job.id == case.id
    assert Case.from_json(job.to_json()) == job
    assert from_args(run_parser().parse_args(job.to_argv()), "cpu") == job
    tuned = dataclasses.replace(job, seed=7, lr=0.5, no_dropout=True,
                                overrides={"num_hidden_layers": 1, "act": "gelu"})
    assert Case.from_json(tuned.to_json()) == tuned
    assert from_args(run_parser().parse_args(tuned.to_argv()), "cpu") == tuned



def test_the_ranks_get_the_case_in_its_encoding_with_its_origin():
    from slapo_ae.harness.runspec import RunSpec

    case = dataclasses.replace(parse_cfg_text("megatron bert-tiny 4 64 0 8 0 pp=2", "x.cfg")[0]
                               .for_run(6, 2, "fp32", "cpu"), source="slapo-bench run", line=3,
                               overrides={"num_hidden_layers": 2})
    again = RunSpec.from_json(RunSpec(case=case, out="r.json", cores=2).to_json())
    assert again.case == case and (again.case.source, again.case.line) == ("slapo-bench run", 3)
    assert again.case_dict() == case.to_record() and again.cores == 2
    assert json.loads(case.to_json(with_origin=True)) == {**json.loads(case.to_json()),
                                                          "source": "slapo-bench run", "line": 3}

def test_a_moved_line_is_the_same_job_and_a_new_batch_value_is_not():
    first = parse_cfg_text("eager bert-tiny 1 64 0 4 0", "a.cfg")[0].for_run(6, 2, "fp32", "cpu")
    moved = parse_cfg_text("\n\neager bert-tiny 1 64 0 '2*2' 0", "b.cfg")[0]
    assert moved.for_run(6, 2, "fp32", "cpu").to_json() == first.to_json()
    other = parse_cfg_text("eager bert-tiny 1 64 0 8 0", "a.cfg")[0].for_run(6, 2, "fp32", "cpu")
    assert other.to_json() != first.to_json()


def test_case_json_and_argv_errors_name_the_field():
    with pytest.raises(CaseError, match="unknown case field.*colour"):
        Case.from_json('{"mode": "eager", "colour": 1}')
    with pytest.raises(CaseError, match="no run settings"):
        parse_cfg_text("eager bert-tiny 1 64 0 4 0")[0].to_argv()
    args = run_parser().parse_args(["--mode", "eager", "--model", "m", "--gpus", "1",
                                    "--seq-len", "8", "--batch-size", "n/0", "--steps", "2",
                                    "--warmup", "1"])
    with pytest.raises(CaseError, match="--batch-size"):
        from_args(args, "cpu")


def test_cfg_line_round_trip(tmp_path):
    cases = parse_cfg(write(tmp_path, SAMPLE), max_gpus=8)
    lines = [to_cfg_line(c) for c in cases]
    assert lines[0] == 'megatron bert-large-uncased 2 512 0 "min(8*n, 48)" full'
    assert lines[-2] == "megatron bert-large-uncased 1 512 0 4 0"
    assert lines[-3] == 'slapo-deepspeed facebook/opt-2.7b 4 1024 0 "16*n" 0'
    again = parse_cfg_text("\n".join(lines), "again.cfg")
    assert again == cases  # source and line take no part in equality
    assert [c.source for c in again] == ["again.cfg"] * len(cases)


def test_expand_gpus():
    assert expand_gpus("8") == [8]
    assert expand_gpus("2,4,8") == [2, 4, 8]
    assert expand_gpus(" 2, 4 ") == [2, 4]
    assert expand_gpus("pow2", 8) == [1, 2, 4, 8]
    assert expand_gpus("pow2", 6) == [1, 2, 4]
    assert expand_gpus("pow2", 1) == [1]
    with pytest.raises(ValueError, match="max_gpus must be 1 to 65536"):  # as a GPUS count is
        expand_gpus("pow2", 10**20)
    for bad in ("pow2", "0", "2,,4", "-2", "two", "2,2", "1.5"):
        with pytest.raises(ValueError):
            expand_gpus(bad)


def test_known_models_lists_close_matches():
    known = {"bert-xlarge", "bert-large-uncased", "t5-3b"}
    assert parse_cfg_text("eager bert-xlarge 1 512 0 12 0", known_models=known)
    with pytest.raises(CfgError, match=r"<string>:1: unknown model 'bert-xlage'.*bert-xlarge"):
        parse_cfg_text("eager bert-xlage 1 512 0 12 0", known_models=known)


def test_a_sequence_longer_than_the_models_positions_is_a_cfg_error():
    known = set(list_models())
    # RoBERTa's positions start after the padding index: 514 entries, 512 positions
    assert parse_cfg_text("eager roberta-tiny 1 512 0 2 0", known_models=known)
    assert parse_cfg_text("eager t5-tiny 1 4096 64 2 0", known_models=known)  # relative
    with pytest.raises(CfgError, match=r"<string>:2: SEQ_LEN 513 is longer than "
                                       r"roberta-tiny's 512 positions"):
        parse_cfg_text("eager bert-tiny 1 512 0 2 0\neager roberta-tiny 1 513 0 2 0",
                       known_models=known)


def test_the_decoder_length_must_fit_the_family():
    # a T5 line without its decoder length launched and failed in the ranks; a BERT line with
    # one was taken, its id gaining d32 (a probe of bad input, 2026-12-05)
    known = set(list_models())
    with pytest.raises(CfgError, match=r"<string>:1: DEC_SEQ_LEN must be the decoder's length "
                                       r"\(>= 1\) for t5-tiny"):
        parse_cfg_text("eager t5-tiny 1 32 0 4 0", known_models=known)
    with pytest.raises(CfgError, match=r"<string>:1: DEC_SEQ_LEN is T5's decoder length; "
                                       r"bert-tiny has no decoder: write 0, got 32"):
        parse_cfg_text("eager bert-tiny 1 64 32 4 0", known_models=known)


def test_a_form_feed_or_line_separator_is_no_line_break():
    # str.splitlines broke the line at them, and every later error named the wrong line
    for odd in ("\x0c", "\u2028"):
        with pytest.raises(CfgError, match=r"x.cfg:2: unknown mode"):
            parse_cfg_text(f"eager bert-tiny 1 64 0 4 0 # a{odd}comment\n"
                           "bogus bert-tiny 1 64 0 4 0", "x.cfg")


@pytest.mark.parametrize(
    "line, says",
    [
        ("megatron bert 2 512 0 16", "expected 7 fields"),
        ("megatron bert 2 512 0 16 0 extra", "expected 7 fields"),
        ("megatorn bert 2 512 0 16 0", "unknown mode 'megatorn' (did you mean megatron"),
        ("megatron bert two 512 0 16 0", "GPUS 'two'"),
        ("megatron bert pow2 512 0 16 0", "needs max_gpus"),
        ("megatron bert 2 5x2 0 16 0", "SEQ_LEN '5x2' is not an integer"),
        ("megatron bert 2 0 0 16 0", "SEQ_LEN '0' must be at least 1"),
        ("megatron bert 2 512 -1 16 0", "DEC_SEQ_LEN '-1' is not an integer"),
        ("megatron bert 2 512 0 '16*m' 0", "BATCH_SIZE"),
        ("megatron bert 2 512 0 \"__import__('os')\" 0", "__import__"),
        ("megatron bert 2 512 0 'n/4' 0", "not an integer batch size"),
        ("megatron bert 2 512 0 '16*n 0", "No closing quotation"),
        ("megatron bert 2 512 0 16 0.5", "megatron takes 'full', 'selective' or 0"),
        ("megatron bert 2 512 0 16 1", "write 'full'"),
        ("slapo-megatron bert 2 512 0 16 full", "'full' is a Megatron setting"),
        ("slapo-deepspeed bert 2 512 0 16 selective", "Megatron setting"),
        ("slapo-megatron bert 2 512 0 16 1.5", "out of [0, 1]"),
        ("deepspeed bert 2 512 0 16 -0.1", "out of [0, 1]"),
        ("eager bert 1 512 0 16 lots", "not a number"),
        ("deepspeed bert 4 512 0 6 0", "not divisible"),
        ("eager bert 2 512 0 3 0", "'3' gives 3 for 2 GPUs, not divisible: eager splits"),
        ("eager bert 99999999999999999999 512 0 8 0", "is more than 65536"),
        ("slapo-kernel bert 2 512 0 3 0", "not divisible"),
        # 3D settings (key=value tokens after the fields)
        ("megatron bert 4 512 0 8 0 pq=2", "unknown option 'pq=2' after the 7 fields (known: pp="),
        ("megatron bert 4 512 0 8 0 pp=2 pp=2", "option pp= is given twice"),
        ("megatron bert 4 512 0 8 0 pp=two", "pp= 'two' is not an integer"),
        ("megatron bert 4 512 0 8 0 tp=0", "tp= '0' must be at least 1"),
        ("megatron bert 4 512 0 8 0 pp=2 extra", "expected 7 fields"),
        ("deepspeed bert 4 512 0 8 0 pp=2", "pp=2: pipeline/tensor/micro-batch settings are "
                                            "for megatron and slapo-megatron, not deepspeed"),
        ("slapo-tp-full bert 4 512 0 8 0 tp=2", "not slapo-tp-full"),
        ("slapo-megatron bert 4 512 0 8 0 pp=3", "pp=3 does not divide the 4 GPUs"),
        ("slapo-megatron bert 8 512 0 8 0 pp=2 tp=3", "pp=2 x tp=3 = 6 does not divide the 8"),
        ("megatron bert 8 512 0 6 0 pp=2 tp=1", "the global batch 6 does not split over 4 "
                                                "data-parallel replicas"),
        ("megatron bert 4 512 0 8 0 pp=2 micro=3", "micro=3 does not divide a replica's batch 8"),
        ("megatron bert 4 512 0 8 0 tp=2 micro=2", "micro=2 needs pp > 1"),
        ("megatron bert 4 512 0 6 0 pp=4 tp=1", "a replica's batch 6 (global 6 / 1 replicas) "
                                                "does not split into pp=4 micro-batches"),
        ("slapo-megatron bert 2,4 512 0 8 0 pp=4", "pp=4 does not divide the 2 GPUs (at 2 GPUs)"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, line, says):
    path = write(tmp_path, f"# header\n\n{line}\n")
    with pytest.raises(CfgError) as err:
        parse_cfg(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: "), message
    assert says in message
    assert isinstance(err.value, ValueError)


def test_all_errors_reported_at_once(tmp_path):
    path = write(tmp_path, "megatron bert 2 512 0 16 0\nfoo bert 2 512 0 16 0\nmegatron bert 2\n")
    with pytest.raises(CfgError) as err:
        parse_cfg(path)
    assert [e.split(": ")[0] for e in err.value.errors] == [f"{path}:2", f"{path}:3"]


def test_duplicate_case_names_both_lines(tmp_path):
    path = write(tmp_path, "megatron bert 2,4 512 0 16 0\n# x\nmegatron bert 4 512 0 '16' 0\n")
    with pytest.raises(CfgError) as err:
        parse_cfg(path)
    assert str(err.value) == (f"{path}:3: duplicate case megatron__bert__g4__s512__b16__c0 "
                              f"(first at {path}:1)")


def test_torchscript_and_ablation_modes_parse():
    text = "torchscript bert 1 512 0 8 0\nslapo-kernel bert-xlarge 1 512 0 20 0\n"
    assert [c.mode for c in parse_cfg_text(text)] == ["torchscript", "slapo-kernel"]


def test_tensor_parallel_modes_take_any_batch():
    assert parse_cfg_text("slapo-megatron bert 2 512 0 3 0")[0].batch_size == 3
    assert parse_cfg_text("megatron bert 2 512 0 3 0")[0].batch_size == 3


def test_3d_tokens_give_the_parallel_layout():
    text = ("slapo-megatron llama-tiny 4 64 0 8 0 pp=2 tp=2\n"
            "megatron gpt-neo-tiny 8 64 0 16 0 micro=2 tp=2 pp=2\n"
            "slapo-megatron llama-tiny 4 64 0 8 0 pp=2\n"
            "megatron llama-tiny 4 64 0 8 0 tp=2\n"
            "slapo-megatron llama-tiny 4 64 0 8 0\n")
    got = [(c.pp, c.tp_size, c.dp_size, c.micro_batch_size, c.n_microbatches)
           for c in parse_cfg_text(text, "x.cfg")]
    assert got == [(2, 2, 1, 4, 2), (2, 2, 2, 2, 4), (2, 2, 1, 4, 2), (1, 2, 2, 4, 1),
                   (1, 4, 1, 8, 1)]
    ids = [c.id for c in parse_cfg_text(text, "x.cfg")]
    assert ids == ["slapo-megatron__llama-tiny__g4__p2__t2__s64__b8__c0",
                   "megatron__gpt-neo-tiny__g8__p2__t2__m2__s64__b16__c0",
                   "slapo-megatron__llama-tiny__g4__p2__s64__b8__c0",  # tp not given: no t part
                   "megatron__llama-tiny__g4__t2__s64__b8__c0",
                   "slapo-megatron__llama-tiny__g4__s64__b8__c0"]  # as before 3D settings
    # the data-parallel modes: one tensor rank, every GPU a replica
    eager = parse_cfg_text("eager bert-tiny 4 64 0 8 0")[0]
    assert (eager.pp, eager.tp_size, eager.dp_size, eager.micro_batch_size) == (1, 1, 4, 2)


def test_3d_tokens_round_trip_through_every_encoding():
    for line in ("megatron gpt-neo-tiny 8 64 0 16 0 pp=2 tp=2 micro=2",
                 "slapo-megatron llama-tiny 4 64 0 8 0 pp=2",
                 "megatron llama-tiny 4 64 0 8 0 tp=1"):
        case = parse_cfg_text(line, "x.cfg")[0]
        assert to_cfg_line(case) == line
        job = case.for_run(steps=4, warmup=1, dtype="fp32", device="cpu")
        assert Case.from_json(job.to_json()) == job
        assert from_args(run_parser().parse_args(job.to_argv()), "cpu") == job
    job = parse_cfg_text("megatron gpt-neo-tiny 8 64 0 16 0 pp=2 tp=2 micro=2")[0].for_run(
        4, 1, "fp32", "cpu")
    argv = job.to_argv()
    assert argv[argv.index("--pp") + 1] == "2" and argv[argv.index("--tp") + 1] == "2"
    assert argv[argv.index("--micro-batch") + 1] == "2"
    record = job.to_record()
    assert {k: record[k] for k in ("pp", "tp", "dp", "micro_batch")} == \
        {"pp": 2, "tp": 2, "dp": 2, "micro_batch": 2}
    # a case without 3D settings keeps its encodings: no new keys, no new options
    plain = parse_cfg_text("megatron llama-tiny 4 64 0 8 0")[0].for_run(4, 1, "fp32", "cpu")
    assert not {"pp", "tp", "micro_batch"} & set(json.loads(plain.to_json()))
    assert not {"--pp", "--tp", "--micro-batch"} & set(plain.to_argv())


def test_3d_settings_from_the_command_line_name_the_flags():
    args = run_parser().parse_args(["--mode", "megatron", "--model", "m", "--gpus", "4",
                                    "--seq-len", "8", "--batch-size", "8", "--steps", "2",
                                    "--warmup", "1", "--pp", "3"])
    with pytest.raises(CaseError, match=r"^--pp/--tp/--micro-batch: pp=3 does not divide"):
        from_args(args, "cpu")
    with pytest.raises(CaseError, match="pp=2 x tp=4 = 8 does not divide the 4 GPUs"):
        Case.from_json('{"mode": "megatron", "model": "m", "gpus": 4, "seq_len": 8, '
                       '"dec_seq_len": 0, "batch_size": 8, "batch_expr": "8", "ckpt": null, '
                       '"pp": 2, "tp": 4}')
