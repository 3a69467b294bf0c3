"""The one reader of the text files a user gives the artifact: cfg files, tuning specs, the
workflow's config, model configs, records.

Such a file is read as UTF-8 (a leading byte-order mark is dropped, line ends become ``\\n``
as :meth:`pathlib.Path.read_text` makes them), whatever the machine's locale says. A file
that is not UTF-8 text (a binary, a file saved in another encoding) raises
:class:`NotTextError`, a ``ValueError`` whose message names the file and the byte offset where
decoding failed, so that each caller refuses it in one line as it refuses any other bad input.
"""
from __future__ import annotations

import codecs
from pathlib import Path


class NotTextError(ValueError):
    """A file that is not UTF-8 text; the message names the file and the byte offset."""

    def __init__(self, path, offset: int, byte: int, why: str):
        self.path, self.offset = str(path), offset
        super().__init__(f"{path}: not UTF-8 text: byte 0x{byte:02x} at offset {offset} "
                         f"cannot be decoded ({why})")


def read_text(path) -> str:
    """The text of the file at ``path``; :class:`NotTextError` if it is not UTF-8, ``OSError``
    if it cannot be read."""
    data = Path(path).read_bytes()
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = start + err.start
        raise NotTextError(path, offset, data[offset], err.reason) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")
