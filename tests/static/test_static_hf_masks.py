"""Traced blocks of transformers models called as transformers 5 calls them: with no attention
mask (None) where one would mask nothing. A block traced with a mask takes it as a graph
input; such a call gets the mask the model left out (``slapo.tracing.hf_inputs``): one that
masks nothing under bidirectional attention, the causal mask where the block's attention is
causal (SDPA's ``is_causal``, which transformers then relies on). Each case traces every
layer of a tiny model from its config, as upstream's schedules traced blocks, and must give
the plain model's loss and every gradient, padded batch or not."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import slapo
from slapo.model_schedule.api import layer_list_path
from slapo_ae.zoo import build_model, model_family, no_dropout, synthetic_batch

CASES = [(name, attn) for name in ("bert-tiny", "roberta-tiny", "llama-tiny", "opt-tiny",
                                   "gpt-neo-tiny")
         for attn in ("eager", "sdpa") if (name, attn) != ("gpt-neo-tiny", "sdpa")]
BIDIRECTIONAL = ("bert", "roberta")


def _loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name, attn", CASES)
def test_traced_layers_take_the_masks_transformers_leaves_out(name, attn, padded):
    family = model_family(name)
    plain = build_model(name, attn_implementation=attn, **no_dropout(name))
    scheduled = copy.deepcopy(plain)
    sch = slapo.create_schedule(scheduled)
    path = layer_list_path(scheduled, family)
    for i in range(len(sch[path].mod)):
        sch[f"{path}.{i}"].trace()  # example inputs from the model's config, a 4-d mask
    assert isinstance(sch[f"{path}.0"].mod, torch.fx.GraphModule)

    batch = synthetic_batch(name, 2, 12, seed=0)
    if padded:
        batch["attention_mask"][1, 9:] = 0
    masks = []  # what the plain model passes its first layer

    def called(mod, args, kwargs):
        bound = inspect.signature(mod.forward).bind(*args, **kwargs).arguments
        masks.append(bound.get("attention_mask"))

    plain.get_submodule(f"{path}.0").register_forward_pre_hook(called, with_kwargs=True)
    expected_loss, expected = _loss_and_grads(plain, batch)
    # the case this is about: transformers 5 leaves the mask out of an unpadded batch under
    # bidirectional attention, and under SDPA for a causal one
    left_out = not padded and (family in BIDIRECTIONAL or attn == "sdpa")
    assert (masks[0] is None) == left_out, (name, attn, padded)

    loss, grads = _loss_and_grads(scheduled, batch)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["opt-tiny", "llama-tiny"])
def test_a_traced_causal_attention_reads_none_as_its_own_forward_does(name, attn):
    """Called with None, transformers' eager attention masks nothing (the model always gives
    it the causal mask), its SDPA attention is causal; traced, each does the same."""
    plain = build_model(name, attn_implementation=attn).eval()
    path = f"{layer_list_path(plain, model_family(name))}.0.self_attn"
    sch = slapo.create_schedule(copy.deepcopy(plain))
    sch[path].trace()
    torch.manual_seed(0)
    x = torch.randn(2, 6, plain.config.hidden_size)
    kwargs = {"attention_mask": None}
    if name == "llama-tiny":
        width = plain.config.head_dim
        kwargs["position_embeddings"] = (torch.randn(2, 6, width), torch.randn(2, 6, width))
    torch.testing.assert_close(sch[path].mod(x, **kwargs)[0],
                               plain.get_submodule(path)(x, **kwargs)[0])


def test_a_causal_block_without_the_length_of_its_queries_is_refused():
    """The causal mask needs ``hidden_states``' length; called with a cache it is not the
    queries' alone, and the call is refused as any None for a graph input is."""
    from slapo.tracing.hf_inputs import skipped_mask_makers

    model = build_model("llama-tiny", attn_implementation="sdpa")
    make = skipped_mask_makers(model.model.layers[0], {"attention_mask": (4, torch.float32)})
    hidden = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    mask = make["attention_mask"]({"hidden_states": hidden})
    assert mask.dtype == torch.bfloat16 and mask.shape == (1, 1, 3, 3)
    assert (mask == 0).tolist()[0][0] == [[True, False, False], [True, True, False],
                                          [True, True, True]]
    assert make["attention_mask"]({"hidden_states": hidden, "past_key_values": object()}) is None
    assert make["attention_mask"]({}) is None
    # bidirectional: a mask that masks nothing, of the traced kind
    make = skipped_mask_makers(build_model("bert-tiny").bert.encoder.layer[0],
                               {"attention_mask": (4, torch.bool),
                                "hidden_states": (3, torch.float32)})
    assert make.keys() == {"attention_mask"}
    assert make["attention_mask"]({}).tolist() == [[[[True]]]]
