"""Table 4: lines of schedule code per model, beside the paper's numbers.

Each family's schedule (``slapo/model_schedule/<family>.py``) is counted by
:func:`slapo_ae.analysis.loc.count_loc`, two numbers per family:

- ``artifact``: the original artifact's rule (the schedule file's lines, leaving out lines
  that contain ``for``), comparable with the paper's row, with the lines of every project
  helper the schedule calls counted as well (the note names them);
- ``statements``: logical statements of schedule code.

A family whose schedule cannot be counted gets an empty row marked ``missing``, never a
made-up number.

    python -m slapo_ae.analysis.table4 --csv results/loc.csv --md figures/table4.md \
--tex figures/table4.tex
"""
from __future__ import annotations

import argparse
import sys

from slapo_ae.analysis.loc import PAPER_LOC, count_loc

# (label, family) in Table 4's column order (docs/paper.md); the paper's numbers are loc's.
MODELS = (("WideResNet", "wideresnet"), ("T5", "t5"), ("RoBERTa", "roberta"), ("LLaMA", "llama"),
          ("OPT", "opt"), ("BERT", "bert"), ("GPT", "gpt_neo"))
COLUMNS = ["model", "family", "paper_loc", "loc_artifact", "loc_statements", "status", "note"]
ARTIFACT_RULE = ("lines of the schedule file and of the project helpers it calls, leaving out "
                 "lines that contain `for`")


def count_schedule(family: str) -> dict:
    """``{"artifact", "statements", "helpers"}`` of ``family``'s schedule
    (:func:`count_loc`)."""
    counted = count_loc(family)
    return {"artifact": counted.lines, "statements": counted.statements,
            "helpers": counted.helpers}


def loc_table(counter=count_schedule):
    """The Table 4 DataFrame (:data:`COLUMNS`); ``counter(family) -> {"artifact",
    "statements"}``."""
    import pandas as pd

    rows = []
    for label, family in MODELS:
        row = {"model": label, "family": family, "paper_loc": PAPER_LOC[family],
               "loc_artifact": None, "loc_statements": None, "status": "missing", "note": ""}
        try:
            counts = counter(family)
            row["loc_artifact"] = int(counts["artifact"])
            row["loc_statements"] = int(counts["statements"])
            row["status"] = "ok"
            if counts.get("helpers"):
                row["note"] = "with " + ", ".join(counts["helpers"])
        except Exception as err:  # a missing schedule is a row, not a crash
            row["note"] = f"{type(err).__name__}: {err}"
        rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS).astype({"loc_artifact": "Int64",
                                                       "loc_statements": "Int64"})


def _cell(value) -> str:
    try:
        import pandas as pd

        if pd.isna(value):
            return "-"
    except (TypeError, ValueError):
        pass
    return str(value)


def to_markdown(df) -> str:
    """Table 4 as a Markdown table, models as rows."""
    lines = [
        "Table 4: lines of schedule code (the configurations of Figure 7).",
        "",
        "| model | paper LoC | LoC (artifact rule) | logical statements | note |",
        "|---|---:|---:|---:|---|",
    ]
    for row in df.to_dict("records"):
        lines.append(f"| {row['model']} | {row['paper_loc']} | {_cell(row['loc_artifact'])} | "
                     f"{_cell(row['loc_statements'])} | {row['note'] or ''} |")
    lines += ["", f"Artifact rule: {ARTIFACT_RULE}. Logical statements: statements of schedule "
              "code. `-`: no schedule for the model yet.", ""]
    return "\n".join(lines)


def _tex_escape(text: str) -> str:
    for char in "&%_#$":
        text = text.replace(char, "\\" + char)
    return text


def to_latex(df) -> str:
    """Table 4 as a LaTeX table (models as columns, as in the paper), booktabs-free."""
    models = [_tex_escape(m) for m in df["model"]]

    def row(name, values):
        return " & ".join([name] + [_cell(v) for v in values]) + r" \\"

    return "\n".join([
        r"\begin{table}[t]",
        r"\centering",
        r"\begin{tabular}{l" + "r" * len(models) + "}",
        r"\hline",
        " & ".join(["Model"] + models) + r" \\",
        r"\hline",
        row("LoC (paper)", df["paper_loc"]),
        row("LoC (artifact rule)", df["loc_artifact"]),
        row("Logical statements", df["loc_statements"]),
        r"\hline",
        r"\end{tabular}",
        r"\caption{Lines of schedule code per model. Artifact rule: lines of the schedule "
        r"file and of the project helpers it calls, leaving out lines that contain "
        r"\texttt{for}.}",
        r"\label{tab:loc}",
        r"\end{table}",
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write Table 4 (CSV, Markdown, LaTeX).")
    parser.add_argument("--csv", required=True)
    parser.add_argument("--md", required=True)
    parser.add_argument("--tex", required=True)
    args = parser.parse_args(argv)
    from slapo_ae.analysis.aggregate import write_csv
    from slapo_ae.atomic import write_text

    df = loc_table()
    write_csv(df, args.csv)
    write_text(args.md, to_markdown(df))
    write_text(args.tex, to_latex(df))
    print(to_markdown(df))
    return 0


if __name__ == "__main__":
    sys.exit(main())
