"""Table 4's line counts: the counting rule on a known source, and every family counted."""

from slapo import model_schedule
from slapo_ae.analysis.loc import FOR_SUBSTRING, PAPER_LOC, count_all, count_loc, count_source
from slapo_ae.zoo import FAMILIES

SOURCE = '''
"""Module docstring: not counted."""
import os  # imports: not counted


def schedule(sch, opts,
             more=None):
    """Docstring: not counted,
    on two lines."""
    # a comment: not counted

    config = sch.mod.config
    for i in range(config.n):
        sch[f"layer.{i}"].shard("weight",
                               axis=0)
    paths = [p for p in config.paths]
    if opts.kernel_opt:
        sch.format_for_kernels()
    return None


def helper(x):
    return [x
            for _ in range(2)]
'''


def test_counting_rule_on_known_source():
    lines, statements, names = count_source(SOURCE)
    assert names == ("schedule", "helper")
    # counted lines: config =, the two lines of the shard call, if, the call (its name
    # contains "for" inside a word only), return, helper's "return [x"
    assert lines == 7
    # statements: config=, for, shard call, paths=, if, call, return; helper's return
    assert statements == 8
    # A literal substring match also drops the line with "format_for_kernels".
    assert count_source(SOURCE, FOR_SUBSTRING)[0] == 6


def test_every_family_has_a_counted_schedule():
    counts = {c.family: c for c in count_all()}
    # the paper's families; slapo schedules more (gpt2, from upstream Slapo)
    assert set(counts) == set(FAMILIES) <= set(model_schedule.FAMILIES)
    for family, count in counts.items():
        assert "schedule" in count.functions
        assert 0 < count.lines <= count.statements + 5, count
        assert count.paper == PAPER_LOC[family]
        # Table 4's claim: a schedule as short as the paper's, by the paper's own rule.
        assert count.lines <= count.paper, count
    print("\n" + "\n".join(f"{c.family}: {c.lines} lines (artifact rule), {c.statements} "
                           f"statements, paper {c.paper}" for c in counts.values()))
    assert count_loc("bert").path == "slapo/model_schedule/bert.py"
