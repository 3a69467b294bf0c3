"""Upstream Slapo's ``generate_pipeline_partition`` on our stage split, in one process: the
same cuts give the same stage modules, chained as ``submod_<k>`` children of the root; the
partitioned model computes the plain model's output and gradients."""

import copy

import pytest
import torch
from static_models import pipeline_batch, pipeline_loss, pipeline_model, pipeline_schedule

from slapo.pipeline import generate_pipeline_partition, split_stages

CUTS = ("bert.encoder.layer.2", "bert.encoder.layer.0")


def test_partition_chains_the_split_stages():
    plain = pipeline_model()
    sch = pipeline_schedule(copy.deepcopy(plain), cuts=CUTS)
    stages = split_stages(sch)
    assert generate_pipeline_partition(sch) is sch
    assert list(sch.child) == ["submod_0", "submod_1", "submod_2"]
    for k, (child, stage) in enumerate(zip(sch.mod.children(), stages)):
        assert child.code == stage.code, f"stage {k}"
        assert [(n, id(p)) for n, p in child.named_parameters()] == \
            [(n, id(p)) for n, p in stage.named_parameters()], f"stage {k}"
    assert split_stages(sch) == list(sch.mod.children())  # what build(target="pipeline") takes
    assert {node.partition_idx for _, node in sch["submod_1"].named_schedules()} == {1}
    assert sch["submod_2.cls"].partition_idx == 2

    ids, mask, labels = pipeline_batch(0)
    loss = pipeline_loss(sch.mod(ids, mask), labels)
    expected = pipeline_loss(plain(input_ids=ids, attention_mask=mask, return_dict=False), labels)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    loss.backward()
    expected.backward()
    grads = {n.split(".", 1)[1]: p.grad for n, p in sch.mod.named_parameters()}
    for name, param in plain.named_parameters():
        if name in grads:  # the traced graph drops parameters the forward does not use
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert "bert.encoder.layer.3.output.dense.weight" in grads


def test_partition_errors():
    sch = pipeline_schedule(pipeline_model())
    with pytest.raises(ValueError, match="takes the schedule root, not 'bert'"):
        generate_pipeline_partition(sch["bert"])
    generate_pipeline_partition(sch)
    with pytest.raises(ValueError, match="already partitioned"):
        generate_pipeline_partition(sch)
