"""Check the config options of a Snakemake command line before Snakemake reads them.

    python workflow/check_args.py SNAKEMAKE_OPTIONS...

Snakemake parses ``--config`` and loads ``--configfile`` before it reads the Snakefile, so
the workflow's own checks (``workflow/rules/common.smk``) never see them: ``--config
profile`` (no ``=``), a key that is not an identifier, or a ``--configfile`` that is not
UTF-8 YAML end in Snakemake's traceback. The Makefile's targets that pass options on
(``SNAKEMAKE_ARGS``) run this first: each problem is one line, ``error: ...``, and the exit
status 2, as the workflow refuses any other bad input. Values are checked by the workflow
itself, against its schema, once Snakemake has parsed them.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the planner beside this file

import plan  # noqa: E402

# Snakemake's rule for a --config key (snakemake.cli.parse_config)
KEY = re.compile(r"[a-zA-Z_][\w-]*\w$")
CONFIG, CONFIGFILE = ("--config", "-C"), ("--configfile", "--configfiles")


def _values(words: list[str], i: int) -> tuple[list[str], int]:
    """The values of the option at ``words[i]`` (``--opt=v``, ``-Cv`` or the words up to the
    next option, as argparse reads Snakemake's ``nargs``) and the index after them."""
    word = words[i]
    if word.startswith("--") and "=" in word:
        return [word.partition("=")[2]], i + 1
    if word.startswith("-C") and len(word) > 2:
        return [word[2:]], i + 1
    j = i + 1
    while j < len(words) and not words[j].startswith("-"):
        j += 1
    return words[i + 1:j], j


def problems(words: list[str]) -> list[str]:
    """What Snakemake would fail on in its parsing of ``words``, one message each."""
    found = []
    i = 0
    while i < len(words):
        flag = words[i].partition("=")[0] if words[i].startswith("--") else words[i]
        if flag in CONFIG or words[i].startswith("-C"):
            values, i = _values(words, i)
            for entry in values:
                key, eq, _ = entry.partition("=")
                if not eq:
                    found.append(f"--config {entry}: an entry is KEY=VALUE (e.g. --config "
                                 f"profile=cpu); --config reads every word up to the next "
                                 f"option, so put targets before it")
                elif not KEY.match(key):
                    found.append(f"--config {entry}: {key!r} is not a config key (a letter or "
                                 "_, then letters, digits, _ or -)")
        elif flag in CONFIGFILE:
            values, i = _values(words, i)
            for path in values:
                try:
                    plan.check_yaml(path)
                except plan.PlanError as err:
                    found.append(f"--configfile {err}")
        else:
            i += 1
    return found


def main(argv=None) -> int:
    found = problems(sys.argv[1:] if argv is None else list(argv))
    for message in found:
        print(f"error: {message}", file=sys.stderr)
    return 2 if found else 0


if __name__ == "__main__":
    sys.exit(main())
