"""Values other than tensors that cross a pipeline cut, in one process: GPT-Neo's stages pass
ints (the sequence length and hidden size that its head's ``view`` needs), LLaMA's the tuple
of rotary embeddings; both split into stages that exchange only tensors and, run one after
another, compute the model. ints, sizes, bools and devices cross as tensors with no elements
whose shape (or device) holds the value; tuples cross item by item, None stays None; a value
that cannot cross (a float) is an error naming the value and the cut.
"""

import pytest
import torch
import torch.fx as fx
from torch import nn

import slapo
from slapo.pipeline import from_carrier, split_stages, to_carrier
from slapo_ae.zoo import build_model, no_dropout, synthetic_batch

CUTS = {"gpt-neo-tiny": "transformer.h.0", "llama-tiny": "model.layers.0"}


def _traced_lm(name):
    model = build_model(name, **no_dropout(name), tie_word_embeddings=False)
    example = synthetic_batch(name, 2, 8, seed=9)
    sch = slapo.create_schedule(model)
    sch.trace(example_inputs={k: example[k] for k in ("input_ids", "attention_mask")},
              concrete_args={"use_cache": False, "return_dict": False})
    sch[CUTS[name]].cut_pipeline_stage()
    return model, sch


def _run_in_sequence(stages, *inputs):
    """Each stage's outputs, feeding the next stage."""
    outputs, values = [], inputs
    for stage in stages:
        values = stage(*values)
        values = values if isinstance(values, tuple) else (values,)
        outputs.append(values)
    return outputs


@pytest.mark.parametrize("name", sorted(CUTS))
def test_language_model_stages_exchange_tensors_only(name):
    model, sch = _traced_lm(name)
    stages = split_stages(sch)
    assert len(stages) == 2
    batch = synthetic_batch(name, 3, 20, seed=1)  # other sizes than the traced ones
    batch["attention_mask"][-1, -4:] = 0
    sent, out = _run_in_sequence(stages, batch["input_ids"], batch["attention_mask"])
    assert all(isinstance(v, torch.Tensor) for v in sent)
    expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     return_dict=False)[0]
    torch.testing.assert_close(out[0], expected, rtol=1e-6, atol=1e-6)
    carried = [v for v in sent if v.numel() == 0]
    if name == "gpt-neo-tiny":  # the sequence length (20) and the hidden size (128)
        assert sorted(v.shape[0] for v in carried) == [20, 128]
    else:  # the rotary embeddings (cos, sin) cross as two tensors, nothing as metadata
        assert carried == [] and sum(v.shape[-1] == 32 for v in sent) == 2


class _Pair(nn.Module):
    """Returns (tensor, None), as HF layers without attention weights do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), None


class _TakesPair(nn.Module):
    def forward(self, pair, h):
        return pair[0] + h if pair[1] is None else h


class _Crossings(nn.Module):
    """An int, a Size, a bool, a device and a tuple holding None, all made before the cut
    after ``a`` and used after it."""

    def __init__(self):
        super().__init__()
        self.first = _Pair()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.last = _TakesPair()

    def forward(self, x):
        z = x * 2.0  # only its metadata is used after the cut, not z itself
        rows, size, device, wide = z.shape[0], z.size(), z.device, z.shape[-1] > 2
        early = torch.ones(1, device=device)  # the device is a node before the cut
        pair = self.first(x)
        h = self.a(pair[0]) * early
        h = self.b(h) + torch.zeros(rows, 1, 1, device=device)
        return self.last(pair, h.reshape(size) * wide)


def _traced_crossings(model, cut="a"):
    sch = slapo.create_schedule(model)
    sch.trace(leaves=[_TakesPair], example_inputs=(torch.randn(2, 3, 4),))
    sch[cut].cut_pipeline_stage()
    return sch


def test_ints_sizes_bools_devices_and_none_cross():
    torch.manual_seed(0)
    model = _Crossings()
    stages = split_stages(_traced_crossings(model))
    x = torch.randn(5, 2, 4)
    sent, out = _run_in_sequence(stages, x)
    torch.testing.assert_close(out[0], model(x))
    kinds = [n.meta["slapo_kind"] for n in stages[1].graph.nodes if n.op == "placeholder"]
    assert set(kinds) == {"tensor"}
    assert sorted(tuple(v.shape) for v in sent if v.numel() == 0) == \
        [(0,), (1, 0), (5, 0), (6, 3, 5, 0)]  # device, bool, int, Size (sizes + 1)
    # the tuple is rebuilt where it is used, its None item in place
    rebuilt = [n for n in stages[1].graph.nodes if n.target is tuple]
    assert len(rebuilt) == 1 and rebuilt[0].args[0][1] is None


def test_carriers_round_trip():
    like = torch.zeros(1)
    for kind, value in (("int", 7), ("int", 0), ("bool", True), ("bool", False),
                        ("Size", torch.Size([2, 3])), ("dtype", torch.bfloat16),
                        ("Size", torch.Size([-1, 0, 3])),  # GPT-2's view to (-1, S, H)
                        ("device", torch.device("cpu"))):
        carrier = to_carrier(value, like, kind, "v")
        assert carrier.numel() == 0 and from_carrier(carrier, kind) == value
        assert type(from_carrier(carrier, kind)) is type(value)
    with pytest.raises(ValueError, match="'x' .* is -3 at run time; only a non-negative int"):
        to_carrier(-3, like, "int", "the value 'x' (int)")
    with pytest.raises(ValueError, match="'s' .* is torch.Size\\(\\[2, -2\\]\\) at run time; "
                                         "a size below -1"):
        to_carrier(torch.Size([2, -2]), like, "Size", "the value 's' (Size)")


class _FloatAcross(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        scale = x.shape[-1] ** 0.5
        return self.b(self.a(x)) / scale


def test_value_that_cannot_cross_is_an_error_naming_it_and_the_cut():
    sch = slapo.create_schedule(_FloatAcross())
    sch.trace(example_inputs=(torch.randn(2, 4),))
    sch["a"].cut_pipeline_stage()
    with pytest.raises(ValueError, match=r"the value 'pow_1' \(float\) that crosses the pipeline "
                                         r"cut after 'a' cannot be passed between stages"):
        split_stages(sch)


def test_untraced_tuple_items_are_an_error():
    sch = _traced_crossings(_Crossings())
    for node in sch.mod.graph.nodes:  # as if traced without item kinds
        node.meta.pop("slapo_items", None)
    with pytest.raises(ValueError, match=r"\(tuple\) that crosses the pipeline cut after 'a' "
                                         r"cannot be passed .* its items are unknown"):
        split_stages(sch)
    assert isinstance(sch.mod, fx.GraphModule)
