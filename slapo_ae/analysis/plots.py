"""Figures 7 (end-to-end throughput), 8 (multi-node) and 9 (ablation) from the aggregate
tables.

All draw samples/s as bars (the median of the timed steps) with a whisker from the first to
the third quartile of the timed steps' samples/s (the CSV's ``samples_per_s_q1`` and
``samples_per_s_q3``, the records' spread), so that a difference inside the noise shows as
whiskers that overlap; the claims judge their verdicts on the same quartiles. Every case whose
status is not ``ok`` (OOM, unsupported, failed) is an X where its bar would be, as the paper
does; the legend says so. A row without quartiles (a record from before they were kept) is a
bar without a whisker.

- :func:`figure7`: one panel per model, GPU counts on the x axis, the four systems
  (Megatron-LM, DeepSpeed ZeRO-3, Slapo-TP, Slapo-ZeRO3) as bars.
- :func:`figure8`: the same panels (:func:`throughput_figure`) for the cases on several
  nodes, the three systems of the paper's Figure 8 (Megatron-LM, DeepSpeed ZeRO-3, Slapo), a
  tick's second line its nodes x GPUs per node, Slapo's bar labelled with its speedup over the
  best baseline that ran, and an X also where a system has no case at a GPU count.
- :func:`figure9`: the ablation's steps (Vanilla, + Kernel Opt, + Attn/FFN TP,
  + Embedding TP) as bars, each labelled with its speedup over Vanilla.

    python -m slapo_ae.analysis.plots e2e results/e2e.csv figures/e2e.pdf
    python -m slapo_ae.analysis.plots multinode results/multinode.csv figures/multinode.pdf
    python -m slapo_ae.analysis.plots ablation results/ablation.csv figures/ablation.pdf
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from slapo_ae import atomic
from slapo_ae.analysis.aggregate import (
    ABLATION_LABELS,
    ABLATION_STEPS,
    BASELINES,
    MULTINODE_SYSTEMS,
    SYSTEM_LABELS,
    SYSTEMS,
)
from slapo_ae.zoo import configs

COLORS = {"megatron": "#4c72b0", "deepspeed": "#dd8452", "slapo-megatron": "#55a868",
          "slapo-deepspeed": "#c44e52"}
STEP_COLORS = ["#8c8c8c", "#64b5cd", "#55a868", "#2f6b3c"]
FAMILY_ORDER = ("bert", "roberta", "gpt_neo", "opt", "t5", "wideresnet", "llama")
X_NOTE = "X: not measured (OOM, unsupported or failed)"
WHISKER_NOTE = "whisker: q1 to q3 of the timed steps"
X_NOTE_MISSING = "X: not measured (OOM, unsupported, failed or no such case)"
# Figure 8's legend, as the paper's: its Slapo runs Megatron-style 3D parallelism
MULTINODE_LABELS = {**SYSTEM_LABELS, "slapo-megatron": "Slapo"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def model_order(models) -> list[str]:
    """Models in the paper's panel order (BERT, RoBERTa, GPT, OPT, T5, WideResNet, then
    others), by family, then by name."""

    def key(model):
        family = configs.model_meta(model).get("family")
        rank = FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER)
        return rank, model

    return sorted(set(models), key=key)


def _ok(row) -> bool:
    value = row.get("samples_per_s")
    return row.get("status") == "ok" and value is not None and not math.isnan(float(value))


def _number(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _quartiles(row) -> tuple[float, float] | None:
    """(q1, q3) of an ok row's per-step samples/s, None where the row has none."""
    q1, q3 = _number(row.get("samples_per_s_q1")), _number(row.get("samples_per_s_q3"))
    return (q1, q3) if q1 is not None and q3 is not None else None


def _top(rows) -> float:
    """The highest point a panel draws: a bar or the end of its whisker (1 when none)."""
    values = [_number(row.get(col)) for row in rows.to_dict("records") if _ok(row)
              for col in ("samples_per_s", "samples_per_s_q3")]
    values = [v for v in values if v]
    return max(values) if values else 1.0


def _bar(ax, x, row, width, color) -> float:
    """An ok row's bar and its q1-q3 whisker; returns the height a label goes above."""
    value = float(row["samples_per_s"])
    ax.bar(x, value, width, color=color, edgecolor="black", linewidth=0.4)
    spread = _quartiles(row)
    if spread is None:
        return value
    q1, q3 = spread
    ax.errorbar([x], [value], yerr=[[max(value - q1, 0.0)], [max(q3 - value, 0.0)]],
                fmt="none", ecolor="black", elinewidth=1.0, capsize=3, capthick=1.0, zorder=4)
    return max(value, q3)


def _legend_whisker(ax):
    """The legend's whisker: an empty errorbar of ``ax`` (nothing drawn), which the legend
    draws as a whisker with its caps."""
    return ax.errorbar([], [], yerr=[[], []], fmt="none", ecolor="black", elinewidth=1.0,
                       capsize=3, capthick=1.0, label=WHISKER_NOTE)


def _x_mark(ax, x, y, color):
    ax.plot([x], [y], marker="x", markersize=9, markeredgewidth=2.2, color=color,
            linestyle="none", zorder=5)


def _legend_x(note=X_NOTE):
    from matplotlib.lines import Line2D

    return Line2D([], [], marker="x", markersize=9, markeredgewidth=2.2, color="black",
                  linestyle="none", label=note)


def _empty(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _title(df, what: str) -> str:
    if df.empty:
        return what
    profile = ", ".join(sorted(str(p) for p in df["profile"].dropna().unique()))
    devices = ", ".join(sorted(str(d) for d in df["device_name"].dropna().unique()))
    bits = [what]
    if profile:
        bits.append(f"profile {profile}")
    if devices:
        bits.append(devices)
    return " | ".join(bits)


def _cells(rows) -> dict:
    """``{mode: row}`` of one GPU count: where a system ran more than once, its fastest ok
    run (the original artifact's plot took the max), else its first row."""
    cells = {}
    for row in rows.to_dict("records"):
        kept = cells.get(row["mode"])
        if kept is None or (_ok(row) and (not _ok(kept) or float(row["samples_per_s"]) >
                                          float(kept["samples_per_s"]))):
            cells[row["mode"]] = row
    return cells


def _tick(sub, gpus: int) -> str:
    """A GPU count's tick: the count, and ``nodes x GPUs per node`` below it on several."""
    nodes = sub.loc[sub["gpus"] == gpus, "nodes"].dropna() if "nodes" in sub else []
    count = int(nodes.max()) if len(nodes) else 1
    return f"{gpus}\n{count} x {gpus // count}" if count > 1 else str(gpus)


def throughput_figure(df, systems, labels: dict, what: str, empty: str,
                      speedup_of: str | None = None, mark_missing: bool = False):
    """Samples/s as bars: one panel per model, GPU counts on the x axis, one bar per system of
    ``systems`` (legend ``labels``), an X for every case that is not ok. ``speedup_of``: a
    system whose bars are labelled with their speedup over the best baseline that ran ok at
    that GPU count; ``mark_missing``: an X too for a system with no case at a GPU count where
    another has one."""
    plt = _plt()
    from matplotlib.patches import Patch

    df = df[df["mode"].isin(systems)] if not df.empty else df
    models = model_order(df["model"].unique()) if not df.empty else []
    ncols = max(1, min(3, len(models)))
    nrows = max(1, math.ceil(len(models) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(4.6 * ncols, 9.0), 3.4 * nrows + 1.35),
                             squeeze=False)
    flat = list(axes.flat)
    cpu = not df.empty and (df["device_count"].fillna(0) == 0).all()
    width = 0.8 / len(systems)
    for ax, model in zip(flat, models):
        sub = df[df["model"] == model]
        gpus = sorted(int(g) for g in sub["gpus"].unique())
        top = _top(sub)
        for gi, g in enumerate(gpus):
            here = _cells(sub[sub["gpus"] == g])
            for si, system in enumerate(systems):
                if system not in here:
                    if mark_missing:
                        _x_mark(ax, gi + (si - (len(systems) - 1) / 2) * width, 0.04 * top,
                                COLORS[system])
                    continue
                row = here[system]
                x = gi + (si - (len(systems) - 1) / 2) * width
                if not _ok(row):
                    _x_mark(ax, x, 0.04 * top, COLORS[system])
                    continue
                value = float(row["samples_per_s"])
                above = _bar(ax, x, row, width, COLORS[system])
                base = [float(here[b]["samples_per_s"]) for b in BASELINES
                        if b in here and _ok(here[b])]
                if system == speedup_of and base:
                    ax.text(x, above + 0.02 * top, f"{value / max(base):.2f}x", ha="center",
                            va="bottom", fontsize=8)
        ax.set_xticks(range(len(gpus)))
        ax.set_xticklabels([_tick(sub, g) for g in gpus])
        ax.set_xlim(-0.6, len(gpus) - 0.4)
        ax.set_ylim(0, top * 1.15)
        label = sub["model_label"].iloc[0] if "model_label" in sub else model
        ax.set_title(label if label == model else f"{label} ({model})", fontsize=10)
        ax.set_xlabel("ranks (CPU processes)" if cpu else "GPUs")
        ax.set_ylabel("samples/s")
        ax.grid(axis="y", alpha=0.3)
    if not models:
        _empty(flat[0], empty)
    for ax in flat[len(models) or 1:]:
        ax.axis("off")
    bars = [Patch(facecolor=COLORS[s], edgecolor="black", label=labels[s]) for s in systems]
    notes = [_legend_whisker(flat[0]), _legend_x(X_NOTE_MISSING if mark_missing else X_NOTE)]
    fig.suptitle(_title(df, what), y=0.995, fontsize=10)
    height = fig.get_figheight()  # the legend's two rows below the title, in inches
    for handles, at in ((bars, 0.42), (notes, 0.66)):
        fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
                   frameon=False, bbox_to_anchor=(0.5, 1 - at / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.9 / height))
    return fig


def figure7(df):
    """Figure 7 from the e2e table (:func:`slapo_ae.analysis.aggregate.table`)."""
    return throughput_figure(df, SYSTEMS, SYSTEM_LABELS, "Figure 7: training throughput",
                             "no e2e cases in this profile")


def figure8(df):
    """Figure 8 from the multinode table (:func:`slapo_ae.analysis.aggregate.table`): Slapo's
    bars carry their speedup over the best baseline; a system missing at a GPU count is an
    X."""
    return throughput_figure(df, MULTINODE_SYSTEMS, MULTINODE_LABELS,
                             "Figure 8: multi-node training throughput",
                             "no multi-node cases in this profile\n(profiles multinode, "
                             "cpu-multinode)", speedup_of="slapo-megatron", mark_missing=True)


def figure9(df):
    """Figure 9 from the ablation table (:func:`slapo_ae.analysis.aggregate.ablation_table`)."""
    plt = _plt()

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = df[df["mode"].isin(ABLATION_STEPS)] if not df.empty else df
    if rows.empty:
        _empty(ax, "no ablation cases in this profile")
    else:
        rows = rows.assign(_step=rows["mode"].map(ABLATION_STEPS.index)).sort_values("_step")
        top = _top(rows)
        labels = []
        for i, (_, row) in enumerate(rows.iterrows()):
            row = row.to_dict()
            color = STEP_COLORS[ABLATION_STEPS.index(row["mode"])]
            labels.append(f"{ABLATION_LABELS[row['mode']]}\n{int(row['gpus'])} "
                          f"{'GPU' if row.get('device_count') else 'rank'}"
                          f"{'s' if int(row['gpus']) > 1 else ''}, batch {int(row['batch_size'])}")
            if _ok(row):
                above = _bar(ax, i, row, 0.6, color)
                speedup = row.get("speedup_vs_vanilla")
                text = (f"{float(speedup):.2f}x" if speedup is not None and speedup == speedup
                        else "n/a")
                ax.text(i, above + 0.02 * top, text, ha="center", va="bottom", fontsize=9)
            else:
                _x_mark(ax, i, 0.04 * top, color)
                ax.text(i, 0.1 * top, str(row["status"]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylim(0, top * 1.2)
        ax.set_ylabel("samples/s")
        ax.grid(axis="y", alpha=0.3)
        model = rows["model_label"].iloc[0]
        ax.legend(handles=[_legend_whisker(ax), _legend_x()], loc="upper left", fontsize=8,
                  frameon=False)
        ax.set_title(_title(rows, f"Figure 9: ablation on {model}") +
                     "\n(label: speedup over Vanilla)", fontsize=9)
    fig.tight_layout()
    return fig


def save(fig, out) -> Path:
    """Save ``fig`` to ``out`` atomically (the format follows the suffix)."""
    out = Path(out)
    try:
        with atomic.replacing(out) as tmp:
            fig.savefig(tmp, metadata={"CreationDate": None} if out.suffix == ".pdf" else None)
    finally:
        _plt().close(fig)
    return out


def main(argv=None) -> int:
    import pandas as pd

    parser = argparse.ArgumentParser(description="Draw Figure 7, 8 or 9 from a CSV.")
    parser.add_argument("figure", choices=("e2e", "multinode", "ablation"))
    parser.add_argument("csv")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    df = pd.read_csv(args.csv)
    draw = {"e2e": figure7, "multinode": figure8, "ablation": figure9}[args.figure]
    fig = draw(df)
    save(fig, args.out)
    print(f"{args.out}: drawn from {len(df)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
