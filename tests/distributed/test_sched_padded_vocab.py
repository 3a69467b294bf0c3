"""Odd vocabularies: the vocabulary projection on padded shapes (``slapo.op.PaddedLinear``)
computes what the model's own Linear does, alone and in a whole schedule, and a vocabulary the
ranks do not divide is sharded with padding (``shard(pad=True)``, the padded words left out of
the vocabulary-parallel loss), which trains as the plain model does.

``PaddedLinear`` pads on CUDA only; here it is made to pad on CPU (``pad_on``), so that the
code a GPU runs is the code checked. The tiny models get a vocabulary of 1001 words: at TP=1
the projection pads it to 1024 in each call; at TP=2 the shard pads it to 1002 (501 words a
rank, the second rank's last one padding) and the projection each rank's 501 rows to 512.
Tolerance: the op alone, fp32, 1e-6 relative (the padded product sums the same terms, plus
zeros); whole models as the other schedule proofs (``sched_helpers``: loss, logits and every
gradient over 3 SGD steps, 1e-5).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from sched_helpers import LR, TINY, assert_equal_training, loss_and_logits, padded_batches, worst

import slapo
from slapo.model_schedule import schedule_model
from slapo.op import PaddedLinear, padded_linear, use_padded_vocab
from slapo.primitives.shard import ShardSpec, full_layout, local_slice, shard_spec
from slapo.verify import relative_error, train_side_by_side
from slapo_ae.zoo import build_model, load_config, no_dropout

VOCAB = 1001
# the row stride of the logits: the projection's padded width where a PaddedLinear pads
# (BERT, RoBERTa, GPT-Neo), else the rows it holds (the whole vocabulary, or a rank's shard)
STRIDES = {(True, 1): 1024, (True, 2): 512, (False, 1): 1001, (False, 2): 501}
FAMILIES = {family: name for family, name in TINY.items() if family != "wideresnet"}
PADDED_PROJECTION = ("bert", "roberta", "gpt_neo")


# --- the op alone -------------------------------------------------------------------------
@pytest.mark.parametrize("with_bias", [True, False])
def test_padded_linear_equals_linear_forward_and_backward(with_bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    weight = torch.randn(1001, 16, generator=gen, requires_grad=True)
    bias = torch.randn(1001, generator=gen, requires_grad=True) if with_bias else None
    grad = torch.randn(3, 5, 1001, generator=gen)
    leaves = [t for t in (x, weight, bias) if t is not None]

    expected = F.linear(x, weight, bias)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    out = padded_linear(x, weight, bias, multiple=128)
    grads = torch.autograd.grad(out, leaves, grad)

    assert out.shape == expected.shape and out.stride(-2) == 1024  # a view of the padded product
    assert relative_error(out, expected) <= 1e-6
    for got, want in zip(grads, expected_grads):
        assert got.shape == want.shape and relative_error(got, want) <= 1e-6


def test_padded_linear_under_autocast_pads_the_cast_weight():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=gen)
    weight = torch.randn(1001, 16, generator=gen, requires_grad=True)
    bias = torch.randn(1001, generator=gen, requires_grad=True)
    padded = []

    class PadDtypes(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.pad:
                padded.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, weight, bias)
        with PadDtypes():
            out = padded_linear(x, weight, bias, multiple=128)
    assert padded == [torch.bfloat16, torch.bfloat16]  # cast first, then padded
    assert out.dtype == expected.dtype == torch.bfloat16
    assert relative_error(out.float(), expected.float()) <= 1e-2
    out.float().sum().backward()
    assert weight.grad.dtype == torch.float32 and weight.grad.shape == weight.shape
    assert bias.grad.dtype == torch.float32 and torch.equal(bias.grad, torch.full((1001,), 4.0))


def test_padded_linear_leaves_an_aligned_shape_alone():
    x, weight = torch.randn(2, 8), torch.randn(256, 8)
    out = padded_linear(x, weight, multiple=128)
    assert out.is_contiguous() and torch.equal(out, F.linear(x, weight))


def test_padded_linear_pads_only_on_its_devices_and_keeps_the_parameters():
    linear = torch.nn.Linear(16, 1001)
    head = PaddedLinear.from_linear(linear)
    assert head.weight is linear.weight and head.bias is linear.bias
    x = torch.randn(2, 16)
    assert head.padding(x) == 0  # CPU: not in the default pad_on, ("cuda",)
    assert head(x).is_contiguous()
    forced = PaddedLinear.from_linear(linear, multiple=64, pad_on=("cpu",))
    assert forced.padding(x) == 23 and forced(x).stride(0) == 1024
    assert torch.allclose(forced(x), linear(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="multiple must be at least 1"):
        PaddedLinear.from_linear(linear, multiple=0)


def test_a_padded_shard_spec_slices_and_reassembles_the_parameter():
    full = torch.arange(10.0).reshape(5, 2)
    spec = ShardSpec(axis=0, world_size=2, full_shape=(5, 2), padded=1)
    slices = [local_slice(full, spec, rank) for rank in range(2)]
    assert spec.local_size == 3 and [tuple(x.shape) for x in slices] == [(3, 2), (3, 2)]
    assert torch.equal(slices[1][-1], torch.zeros(2))  # the last rank holds the padding
    assert torch.equal(full_layout(torch.cat(slices), spec), full)


def test_use_padded_vocab_replaces_the_output_embedding_and_keeps_its_ties():
    model = build_model("bert-tiny", vocab_size=1002)
    sch = slapo.create_schedule(model)
    assert use_padded_vocab(sch) == "cls.predictions.decoder"
    head = model.get_output_embeddings()
    assert isinstance(head, PaddedLinear)
    assert head.weight is model.get_input_embeddings().weight  # tied to the word embedding
    assert head.bias is model.cls.predictions.bias  # and BERT's head bias to its decoder's
    assert use_padded_vocab(sch) is None  # once is enough
    assert use_padded_vocab(slapo.create_schedule(torch.nn.Linear(2, 2))) is None


# --- in schedules, one rank and two -------------------------------------------------------
def _odd_vocab_model(name):
    fields = load_config(name)
    overrides = dict(no_dropout(name), vocab_size=VOCAB)
    overrides.update({key: 1 for key in ("bos_token_id", "eos_token_id")  # inside the vocab
                      if (fields.get(key) or 0) >= VOCAB})
    return build_model(name, **overrides)


def _padding_on_cpu(plain, **options):
    """A copy of ``plain`` with its kernel schedule for CPU and ``options``, and its LM head,
    made to pad here where it is a ``PaddedLinear`` (the CUDA path)."""
    sch = slapo.create_schedule(copy.deepcopy(plain))
    schedule_model(sch, device="cpu", kernel_opt=True, **options)
    scheduled = slapo.build_module(sch)
    head = scheduled.get_output_embeddings()
    if isinstance(head, PaddedLinear):
        head.pad_on = ("cpu",)
    return scheduled, head


def _odd_vocab_schedules():
    torch.manual_seed(0)
    world = torch.distributed.get_world_size()
    results = {}
    for family, name in FAMILIES.items():
        plain = _odd_vocab_model(name)
        scheduled, head = _padding_on_cpu(plain, tensor_parallel=True, shard_embedding=True)
        strides = []
        head.register_forward_hook(
            lambda mod, args, out, seen=strides: seen.append(out.stride(-2)))
        reports = train_side_by_side(plain, scheduled, padded_batches(plain.config),
                                     loss_and_logits, lr=LR)
        spec = shard_spec(scheduled.get_input_embeddings().weight)
        results[family] = dict(reports=reports, head=type(head).__name__, strides=strides,
                               padded=spec.padded if spec else None, world=world,
                               tied=head.weight is scheduled.get_input_embeddings().weight)
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def odd_vocab_results(request):
    return run_ranks(_odd_vocab_schedules, world_size=request.param)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_schedule_of_an_odd_vocabulary_equals_plain(odd_vocab_results, family):
    for rank, results in enumerate(odd_vocab_results):
        facts = results[family]
        world, projection = facts["world"], family in PADDED_PROJECTION
        assert facts["head"] == ("PaddedLinear" if projection else "Linear"), facts
        if projection:
            assert facts["tied"], f"{family}: the LM head no longer shares the word embedding"
        # one word of padding in the shard at TP=2 (none at TP=1, where nothing is sharded)
        assert facts["padded"] == (1 if world == 2 else None), facts
        # every forward multiplied on the expected shape (at TP=2 a padded projection runs
        # through the overlap's deferred product: its input gradient overlaps its weight's)
        assert facts["strides"] and set(facts["strides"]) == {STRIDES[projection, world]}, facts
        assert_equal_training(facts["reports"], f"{family} tp{world} rank {rank}")
    print(f"{family} tp{world}: worst gradient error per step "
          f"{worst(odd_vocab_results[0][family]['reports'])}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-tiny", "gpt-neo-tiny"])
def test_compiled_loss_of_a_padded_projection_trains_as_plain(name):
    """The CUDA path on one process, compiled by Inductor on CPU: compiled layers, the
    compiled loss, and the projection made to pad here. The loss reads the padded product
    (``compiled_cross_entropy``: the logits' slice has no backward of its own); loss, logits
    and every gradient as the plain model's over 3 SGD steps (1e-4, as the other compiled
    schedules: Inductor reassociates fp32 sums)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    plain = _odd_vocab_model(name)
    scheduled, head = _padding_on_cpu(plain, tensor_parallel=False, compile_layers=True)
    widths = []
    head.register_forward_hook(lambda mod, args, out: widths.append(out._base.shape[-1]))
    reports = train_side_by_side(plain, scheduled, padded_batches(plain.config),
                                 loss_and_logits, lr=LR)
    assert set(widths) == {1024}, widths  # the 1001 words padded in every forward
    assert_equal_training(reports, f"{name} compiled, padded", tol=1e-4)
    torch._dynamo.reset()
