"""Every file the artifact reads from a user goes through one reader (slapo_ae/textfile.py):
a file that is not UTF-8 text is refused in one line naming the file and the byte offset
where decoding failed, by each reader in the error it uses for any other bad input."""
from __future__ import annotations

import codecs

import pytest

from slapo_ae import textfile
from slapo_ae.cfg import CfgError, parse_cfg
from slapo_ae.record import RecordError, read_record
from slapo_ae.tuning import TuningError, load_tuning
from slapo_ae.zoo.configs import load_config

BINARY = b"eager bert-tiny 1 16 0 2 0\n" + bytes(range(128, 256)) * 24  # offset 27: 0x80


def test_utf8_text_reads_with_its_byte_order_mark_dropped_and_line_ends_made_newlines(tmp_path):
    path = tmp_path / "a.cfg"
    path.write_bytes(codecs.BOM_UTF8 + "eager bert-tiny 1 16 0 2 0 # é\r\nnext\rlast\n".encode())
    assert textfile.read_text(path) == "eager bert-tiny 1 16 0 2 0 # é\nnext\nlast\n"


def test_a_file_that_is_not_text_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "random.cfg"
    path.write_bytes(BINARY)
    with pytest.raises(textfile.NotTextError) as err:
        textfile.read_text(path)
    assert str(err.value) == (f"{path}: not UTF-8 text: byte 0x80 at offset 27 cannot be "
                              "decoded (invalid start byte)")
    assert err.value.offset == 27
    # the offset counts the file's bytes, a byte-order mark included; a character cut short
    path.write_bytes(codecs.BOM_UTF8 + b"ok \xc3")
    with pytest.raises(textfile.NotTextError, match="byte 0xc3 at offset 6 .*unexpected end"):
        textfile.read_text(path)


def test_a_cfg_file_that_is_not_text_is_a_cfg_error(tmp_path):
    path = tmp_path / "random.cfg"
    path.write_bytes(BINARY)
    with pytest.raises(CfgError) as err:
        parse_cfg(path)
    assert err.value.errors == [f"{path}: not UTF-8 text: byte 0x80 at offset 27 cannot be "
                                "decoded (invalid start byte)"]


def test_a_tuning_spec_that_is_not_text_is_a_tuning_error(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_bytes(b'case: "eager bert-tiny 1 16 0 b 0"\n\xff\xfe\n')
    with pytest.raises(TuningError, match=rf"^{path}: not UTF-8 text: byte 0xff at offset 35 "):
        load_tuning(path)


def test_a_model_config_that_is_not_text_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAPO_MODEL_CONFIGS", str(tmp_path))
    (tmp_path / "latin1.json").write_bytes('{"model_type": "bert", "note": "café"}'
                                           .encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.json: not UTF-8 text: byte 0xe9 at offset "
                                         r"35 cannot be decoded"):
        load_config("latin1")


def test_a_record_that_is_not_text_is_a_record_error(tmp_path):
    path = tmp_path / "r.json"
    path.write_bytes(BINARY)
    with pytest.raises(RecordError, match=rf"{path}: not UTF-8 text: byte 0x80 at offset 27"):
        read_record(path)
