"""Print the project's pinned requirements from pyproject.toml, one a line, for pip.

The Docker image installs its own build of torch first (a CUDA build that runs on the base
image, or the CPU build of the pin) and then everything else the project pins, from this list.
pyproject.toml stays the one place where versions are written.

    python docker/requirements.py                     # dependencies + extra "all", no torch
    python docker/requirements.py --extras test       # dependencies + extra "test"
    python docker/requirements.py --keep torch        # keep torch in the list (the CPU wheelhouse)
    python docker/requirements.py --build-system      # also [build-system].requires

Self-references such as ``slapo[models,baselines]`` inside an extra are expanded in place.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[([^\]]*)\])?")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(
    pyproject: dict,
    extras: list[str],
    drop: set[str],
    build_system: bool = False,
) -> list[str]:
    """The requirement strings of the base dependencies plus ``extras``, minus ``drop``."""
    project = pyproject["project"]
    own = _canonical(project["name"])
    optional = project.get("optional-dependencies", {})
    drop = {_canonical(d) for d in drop}
    out: list[str] = []
    seen_extras: set[str] = set()

    def add(req: str) -> None:
        match = _NAME.match(req)
        if match is None:
            raise ValueError(f"cannot parse requirement {req!r}")
        name = _canonical(match.group(1))
        if name == own:
            for extra in (match.group(3) or "").split(","):
                add_extra(extra.strip())
            return
        if name not in drop and req not in out:
            out.append(req.strip())

    def add_extra(extra: str) -> None:
        if not extra or extra in seen_extras:
            return
        if extra not in optional:
            raise KeyError(f"no extra {extra!r} in pyproject.toml (have: {sorted(optional)})")
        seen_extras.add(extra)
        for req in optional[extra]:
            add(req)

    if build_system:
        for req in pyproject.get("build-system", {}).get("requires", []):
            add(req)
    for req in project.get("dependencies", []):
        add(req)
    for extra in extras:
        add_extra(extra)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path,
                        default=Path(__file__).resolve().parents[1] / "pyproject.toml")
    parser.add_argument("--extras", default="all", help="comma-separated extras (default: all)")
    parser.add_argument("--drop", default="torch",
                        help="comma-separated packages to leave out (default: torch)")
    parser.add_argument("--keep", default="",
                        help="comma-separated packages to keep although --drop names them")
    parser.add_argument("--build-system", action="store_true", help="add [build-system].requires")
    args = parser.parse_args(argv)

    with args.pyproject.open("rb") as fh:
        pyproject = tomllib.load(fh)
    drop = {d for d in args.drop.split(",") if d} - {k for k in args.keep.split(",") if k}
    extras = [e for e in args.extras.split(",") if e]
    for req in requirements(pyproject, extras, drop, build_system=args.build_system):
        sys.stdout.write(req + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
