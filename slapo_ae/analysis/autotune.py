"""The tunings' results: ``results/autotune.csv``, ``results/autotune.json``, the chosen
configurations as a cfg file (``results/autotune.cfg``) and Figure 10 (``figures/autotune.pdf``).

Each tuning's strategies end in a final round file (:mod:`slapo_ae.harness.tune`) naming the
spec, the folder of the trials' records, every trial it ran and its best. From those:

- the CSV: one row per point of each tuning's grid: the case, the point's symbols (``config``,
  JSON), its status (``ok``, ``oom``, ``failed``, ``unsupported``, or ``not-run`` when no
  strategy tried it), samples/s with its quartiles, which strategies ran it (``ran_by``) and
  whether it is the tuning's chosen configuration;
- the JSON: per tuning the symbols, the grid size, per strategy its trials, rounds and best,
  the chosen configuration (the best of the spec's first strategy), and, when both ran, how
  many trials the pruning search ran against the grid and whether it found the grid's best;
- the cfg file: the chosen configuration of each tuning as a cfg line (its model's case with
  the tuned batch and ratio), to paste into a cfg file or to feed back with ``--config
  tuned=true`` (docs/workflow.md);
- the figure: per tuning a heat map of samples/s over the two symbols (the pruning search's
  symbol up, the other across, as the paper's Figure 10), an X on each point that was not
  ``ok`` (OOM and the rest), empty cells for points not run, a dot on each trial of the pruning
  search when the grid ran too, and a star on the chosen point.

    python -m slapo_ae.analysis.autotune table --csv C --json J --cfg F ROUND.json ...
    python -m slapo_ae.analysis.autotune figure J figures/autotune.pdf
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from slapo_ae import atomic
from slapo_ae.cfg import to_cfg_line
from slapo_ae.record import RecordError, read_record
from slapo_ae.tuning import TuningError, load_tuning

COLUMNS = ["tuning", "profile", "case_id", "mode", "model", "gpus", "seq_len", "dec_seq_len",
           "batch_size", "ckpt", "config", "status", "reason", "samples_per_s",
           "samples_per_s_q1", "samples_per_s_q3", "ran_by", "chosen", "record"]


def _final_rounds(paths) -> dict[str, dict[str, dict]]:
    """``{tuning: {strategy: final round}}`` of the given round files."""
    found: dict[str, dict[str, dict]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not data.get("done"):
            raise ValueError(f"{path}: round {data.get('round')} of {data.get('tuning')} is not "
                             "the last (done is false)")
        found.setdefault(data["tuning"], {})[data["strategy"]] = data
    return found


def _point(case_id: str, records: Path, ran_by: list[str]) -> dict:
    if not ran_by:
        return {"status": "not-run", "device_name": None, "reason": "", "samples_per_s": None,
                "q1": None, "q3": None, "record": None}
    path = records / f"{case_id}.json"
    rec = read_record(path)
    spread = rec.metrics.spread or {}
    ok = rec.status == "ok"
    return {"status": rec.status, "device_name": rec.env.get("device_name"),
            "reason": rec.reason.splitlines()[0] if rec.reason else "",
            "samples_per_s": rec.metrics.samples_per_s if ok else None,
            "q1": spread.get("q1") if ok else None, "q3": spread.get("q3") if ok else None,
            "record": str(path)}


def summarize(round_paths) -> dict:
    """``{tuning: summary}`` (see the module docstring)."""
    out = {}
    for name, finals in sorted(_final_rounds(round_paths).items()):
        first = next(iter(finals.values()))
        spec = load_tuning(first["spec"])
        records = Path(first["records"])
        ran = {s: {t["case_id"] for t in final["trials"]} for s, final in finals.items()}
        strategies = {s: {"trials": len(final["trials"]), "rounds": final["round"],
                          "grid_size": final["grid_size"], "best": final["best"]}
                      for s, final in finals.items()}
        chooser = next(s for s in spec.strategies if s in finals)
        best = finals[chooser]["best"]
        points = []
        for case_id, (config, case) in spec.cases().items():
            ran_by = [s for s in spec.strategies if case_id in ran.get(s, ())]
            points.append({"case_id": case_id, "config": config, "batch_size": case.batch_size,
                           "ckpt": case.ckpt_token, "ran_by": ran_by,
                           "chosen": bool(best and best["case_id"] == case_id),
                           **_point(case_id, records, ran_by)})
        chosen = None
        if best:
            case = spec.case_for(best["config"])
            chosen = {"strategy": chooser, **best, "batch_size": case.batch_size,
                      "ckpt": case.ckpt_token, "cfg_line": to_cfg_line(case)}
        comparison = None
        if "prune" in finals and "grid" in finals:
            grid_best, prune_best = finals["grid"]["best"], finals["prune"]["best"]
            comparison = {
                "prune_trials": len(finals["prune"]["trials"]),
                "grid_trials": len(finals["grid"]["trials"]),
                "found_grid_best": bool(grid_best and prune_best
                                        and grid_best["case_id"] == prune_best["case_id"]),
                "grid_best": grid_best, "prune_best": prune_best}
        t = spec.template
        devices = sorted({p["device_name"] for p in points if p["device_name"]})
        out[name] = {"tuning": name, "spec": spec.path, "description": spec.description,
                     "profile": records.name, "mode": t.mode, "model": t.model, "gpus": t.gpus,
                     "seq_len": t.seq_len, "dec_seq_len": t.dec_seq_len,
                     "memory_per_rank_mib": spec.memory_per_rank, "devices": devices,
                     "symbols": [{"name": s.name, "values": list(s.values), "memory": s.memory}
                                 for s in spec.symbols],
                     "along": spec.along, "grid_size": len(points), "strategies": strategies,
                     "chosen": chosen, "prune_vs_grid": comparison, "points": points}
    return out


def table(summary: dict):
    """The CSV's DataFrame (:data:`COLUMNS`), one row per grid point of each tuning."""
    import pandas as pd

    rows = []
    for name, tuning in summary.items():
        for p in tuning["points"]:
            rows.append({"tuning": name, "profile": tuning["profile"], "case_id": p["case_id"],
                         "mode": tuning["mode"], "model": tuning["model"],
                         "gpus": tuning["gpus"], "seq_len": tuning["seq_len"],
                         "dec_seq_len": tuning["dec_seq_len"], "batch_size": p["batch_size"],
                         "ckpt": p["ckpt"], "config": json.dumps(p["config"]),
                         "status": p["status"], "reason": p["reason"],
                         "samples_per_s": p["samples_per_s"], "samples_per_s_q1": p["q1"],
                         "samples_per_s_q3": p["q3"], "ran_by": ";".join(p["ran_by"]),
                         "chosen": p["chosen"], "record": p["record"]})
    return pd.DataFrame(rows, columns=COLUMNS)


def chosen_cfg(summary: dict) -> str:
    """The chosen configurations as a cfg file (one line per tuning that found one)."""
    lines = ["# The configurations chosen by the tunings (results/autotune.json): each is its",
             "# model's case with the tuned batch and checkpoint ratio. Feed them back with",
             "# `--config tuned=true`, or paste a line into a cfg file of configs/e2e/."]
    for name, tuning in summary.items():
        chosen = tuning["chosen"]
        if chosen is None:
            lines.append(f"# {name}: no trial was ok; nothing chosen")
            continue
        runs = tuning["strategies"][chosen["strategy"]]
        lines.append(f"# {name}: {chosen['samples_per_s']:.4g} samples/s at {chosen['config']}, "
                     f"{runs['trials']} trials of a grid of {tuning['grid_size']} "
                     f"({chosen['strategy']}, profile {tuning['profile']})")
        lines.append(chosen["cfg_line"])
    return "\n".join(lines) + "\n"


# -- the figure -----------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _heat_map(ax, fig, tuning: dict) -> None:
    import numpy as np

    along = next(s for s in tuning["symbols"] if s["name"] == tuning["along"])
    across = next(s for s in tuning["symbols"] if s["name"] != tuning["along"])
    ys, xs = sorted(along["values"]), sorted(across["values"])
    grid = np.full((len(ys), len(xs)), np.nan)
    for p in tuning["points"]:
        y, x = ys.index(p["config"][along["name"]]), xs.index(p["config"][across["name"]])
        if p["samples_per_s"] is not None:
            grid[y, x] = p["samples_per_s"]
    mesh = ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", cmap="viridis")
    fig.colorbar(mesh, ax=ax, label="samples/s")
    both = len(tuning["strategies"]) > 1 and "prune" in tuning["strategies"]
    for p in tuning["points"]:
        y, x = ys.index(p["config"][along["name"]]), xs.index(p["config"][across["name"]])
        if p["status"] == "ok":
            value = p["samples_per_s"]
            ax.text(x, y, f"{value:.3g}", ha="center", va="center", fontsize=7,
                    color="white" if value < np.nanmean(grid) else "black")
        elif p["status"] != "not-run":
            ax.plot([x], [y], marker="x", markersize=10, markeredgewidth=2.2, color="#c44e52",
                    linestyle="none")
        if both and "prune" in p["ran_by"]:
            ax.plot([x + 0.32], [y + 0.3], marker="o", markersize=3.5, color="#8c1aa3",
                    linestyle="none")
        if p["chosen"]:
            ax.plot([x], [y - 0.28], marker="*", markersize=11, color="#ffbf00",
                    markeredgecolor="black", linestyle="none")
    ax.set_xticks(range(len(xs)), [f"{v:g}" for v in xs], fontsize=8)
    ax.set_yticks(range(len(ys)), [f"{v:g}" for v in ys], fontsize=8)
    ax.set_xlabel(across["name"])
    ax.set_ylabel(along["name"])
    strategies = ", ".join(f"{s}: {r['trials']} trials" for s, r in tuning["strategies"].items())
    chosen = tuning["chosen"]
    best = (f"best {chosen['samples_per_s']:.4g} samples/s at {chosen['config']}" if chosen
            else "no trial ok")
    where = ", ".join(tuning["devices"]) or "no device"
    cpu = all(d.startswith("cpu") for d in tuning["devices"])
    ax.set_title(f"{tuning['tuning']}: {tuning['mode']} {tuning['model']}, {tuning['gpus']} "
                 f"{'CPU rank' if cpu else 'GPU'}{'s' if tuning['gpus'] > 1 else ''} ({where})\n"
                 f"grid {tuning['grid_size']} ({strategies}); {best}", fontsize=8)


def figure(summary: dict):
    """Figure 10: one heat map per tuning (see the module docstring)."""
    plt = _plt()
    from matplotlib.lines import Line2D

    tunings = list(summary.values())
    fig, axes = plt.subplots(1, max(1, len(tunings)), figsize=(6.2 * max(1, len(tunings)), 4.6),
                             squeeze=False)
    for ax, tuning in zip(axes.flat, tunings):
        if len(tuning["symbols"]) != 2:
            ax.text(0.5, 0.5, f"{tuning['tuning']}: a heat map needs two symbols "
                    f"({len(tuning['symbols'])} here); see results/autotune.csv",
                    ha="center", va="center", transform=ax.transAxes, fontsize=8)
            ax.axis("off")
            continue
        _heat_map(ax, fig, tuning)
    if not tunings:
        axes[0, 0].text(0.5, 0.5, "no tuning in this profile", ha="center", va="center")
        axes[0, 0].axis("off")
    handles = [Line2D([], [], marker="x", color="#c44e52", markeredgewidth=2.2,
                      linestyle="none", label="not ok (OOM, failed)"),
               Line2D([], [], marker="*", color="#ffbf00", markeredgecolor="black",
                      markersize=11, linestyle="none", label="chosen configuration"),
               Line2D([], [], marker="o", color="#8c1aa3", markersize=3.5, linestyle="none",
                      label="a trial of the pruning search (with the grid run too)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle("Figure 10: autotuning (empty cells: not run)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    return fig


def save(fig, out) -> Path:
    out = Path(out)
    try:
        with atomic.replacing(out) as tmp:
            fig.savefig(tmp, format=out.suffix.lstrip(".") or "pdf",
                        metadata={"CreationDate": None} if out.suffix == ".pdf" else None)
    finally:
        _plt().close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Aggregate and draw the tunings.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("table", help="CSV, JSON summary and the chosen configurations")
    p.add_argument("--csv", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--cfg", required=True)
    p.add_argument("rounds", nargs="*", help="the final round file of each tuning's strategy")
    p = sub.add_parser("figure", help="Figure 10 from the JSON summary")
    p.add_argument("summary")
    p.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.command == "figure":
            summary = json.loads(Path(args.summary).read_text())
            save(figure(summary), args.out)
            print(f"{args.out}: {len(summary)} tunings")
            return 0
        summary = summarize(args.rounds)
    except (TuningError, RecordError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    df = table(summary)
    with atomic.replacing(args.csv) as tmp:
        df.to_csv(tmp, index=False)
    atomic.write_text(args.json, json.dumps(summary, indent=1, default=_plain) + "\n")
    atomic.write_text(args.cfg, chosen_cfg(summary))
    for name, tuning in summary.items():
        runs = ", ".join(f"{s} {r['trials']} trials" for s, r in tuning["strategies"].items())
        print(f"{name}: grid {tuning['grid_size']}, {runs}, chosen {tuning['chosen']}")
    return 0


def _plain(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON")


if __name__ == "__main__":
    sys.exit(main())
