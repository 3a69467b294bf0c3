"""Table 4's line counts: the counting rule on a known source, and every family counted."""

from slapo import model_schedule
from slapo_ae.analysis.loc import (
    FOR_SUBSTRING,
    PAPER_LOC,
    count_all,
    count_file,
    count_loc,
    count_source,
    schedule_path,
)
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


HELPERS = {
    "common.py": '''
from slapo.op import library_kernel  # the library: not counted


def shard_pair(node):
    node["a"].shard("weight", axis=0)
    _sync(node)


def _sync(node):
    node.sync("bwd_post", "all_reduce")
    library_kernel(node)


def unused(node):
    return node
''',
    "__init__.py": '''
def checkpoint_first(layers):
    layers[0].checkpoint()
''',
    "family.py": '''
from . import checkpoint_first
from .common import shard_pair


def schedule(sch, opts):
    layers = [sch["a"], sch["b"]]
    for layer in layers:
        shard_pair(layer)
    checkpoint_first(layers)
''',
}


def test_helpers_a_schedule_calls_are_counted_with_it(tmp_path):
    for name, source in HELPERS.items():
        (tmp_path / name).write_text(source)
    lines, statements, names, helpers = count_file(tmp_path / "family.py")
    assert names == ("schedule",)
    # reached through the calls, each once; the unused helper and the library are not counted
    assert helpers == ("__init__.checkpoint_first", "common.shard_pair", "common._sync")
    # schedule: layers =, shard_pair(...), checkpoint_first(...) (the "for" line is left out);
    # checkpoint_first: 1; shard_pair: 2; _sync: 2
    assert lines == 3 + 1 + 2 + 2
    assert statements == 4 + 1 + 2 + 2


def test_every_family_has_a_counted_schedule():
    counts = {c.family: c for c in count_all()}
    # the paper's families; slapo schedules more (gpt2, from upstream Slapo)
    assert set(counts) == set(FAMILIES) <= set(model_schedule.FAMILIES)
    for family, count in counts.items():
        assert "schedule" in count.functions
        assert 0 < count.lines <= count.statements + 5, count
        assert count.paper == PAPER_LOC[family]
        own = count_source(schedule_path(family).read_text())[0]
        assert own < count.lines, f"{family}: the helpers it calls are counted with it"
    # the pieces of schedule that families share; the kernels (slapo.op) are library code
    assert "common.sdpa_gpt_neo" in counts["gpt_neo"].helpers
    assert "common.shard_batchnorm" in counts["wideresnet"].helpers
    print("\n" + "\n".join(f"{c.family}: {c.lines} lines (artifact rule), {c.statements} "
                            f"statements, paper {c.paper}; helpers {', '.join(c.helpers)}"
                            for c in counts.values()))
    assert count_loc("bert").path == "slapo/model_schedule/bert.py"
