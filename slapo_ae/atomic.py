"""The one atomic file writer: every record, CSV, figure and summary the artifact writes.

A file is written to a temporary name in its own folder, flushed and fsync'ed, then renamed
over the target (:func:`os.replace`), and the rename made durable: an interrupted run leaves
the old file or the new one, never half of one, and Snakemake's bookkeeping reruns what is
missing. The file gets the mode a plain ``open`` would give (0666 less the umask), not the
0600 of :func:`tempfile.mkstemp`, so results written as root on a mounted folder stay
readable by the user who asked for them.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _sync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write (by any library: pandas, matplotlib);
    on success it replaces ``path``, on error it is removed and ``path`` is left as it was.
    The suffix is kept, for writers that pick a format from it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)


def write_text(path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with replacing(path) as tmp:
        tmp.write_text(text)
    return Path(path)
