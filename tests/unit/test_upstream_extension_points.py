"""Upstream Slapo's extension points and module paths, on one process: a primitive given as a
``slapo.primitives.base.Primitive`` class (with its metadata), model schedules registered with
``slapo.model_schedule.registry`` and run by ``apply_schedule`` as upstream ran them, upstream's
keyword names of ``shard``/``replace``/``replace_all``, and the modules its scripts import
(``slapo.env``, ``slapo.initialization``, ``slapo.tracer``, ``slapo.utils.report_memory``)."""

from collections import OrderedDict

import pytest
import torch
from torch import fx, nn

import slapo
from slapo.model_schedule import apply_schedule
from slapo.model_schedule import registry as schedule_registry
from slapo.primitives import base


@pytest.fixture
def fresh_registries():
    """Registrations made by a test are removed after it (the registries are global)."""
    registered = dict(base._REGISTERED)
    methods = {name: dict(steps) for name, steps in schedule_registry.SCHEDULE_METHODS.items()}
    schedules = dict(schedule_registry.SCHEDULES)
    yield
    base._REGISTERED.clear(), base._REGISTERED.update(registered)
    schedule_registry.SCHEDULE_METHODS.clear()
    schedule_registry.SCHEDULE_METHODS.update(methods)
    schedule_registry.SCHEDULES.clear(), schedule_registry.SCHEDULES.update(schedules)


def test_a_primitive_class_is_called_by_its_name_and_keeps_its_metadata(fresh_registries):
    @base.register_primitive()
    class ScaleInit(base.Primitive):
        """Scale a parameter in place and record the factor."""

        @staticmethod
        def name():
            return "scale_init"

        @staticmethod
        def apply(sch, param_name, factor):
            with torch.no_grad():
                sch.mod.get_parameter(param_name).mul_(factor)
            sch.metadata.primitives["scale_init"][param_name] = factor

        @staticmethod
        def init_metadata():
            return OrderedDict()

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = model[0].weight.detach().clone()
    sch = slapo.create_schedule(model)
    sch["0"].scale_init("weight", 0.5)
    torch.testing.assert_close(model[0].weight, before * 0.5)
    assert dict(sch["0"].metadata.primitives["scale_init"]) == {"weight": 0.5}
    assert dict(sch.metadata.primitives["scale_init"]) == {}  # each node its own entry
    assert "scale_init" in slapo.list_primitives()
    registered = slapo.list_primitives(name_only=False)
    assert registered["scale_init"] is ScaleInit
    assert registered["shard"] is slapo.get_primitive("shard")  # a function, as registered
    assert "Scale a parameter" in sch["0"].scale_init.__doc__
    assert sch["0"].get_top_schedule() is sch


def test_a_primitive_class_is_checked_when_registered(fresh_registries):
    class NotAPrimitive:
        @staticmethod
        def name():
            return "not_a_primitive"

    with pytest.raises(ValueError, match="not a subclass of slapo.primitives.base.Primitive"):
        base.register_primitive()(NotAPrimitive)

    class NoApply(base.Primitive):
        @staticmethod
        def name():
            return "no_apply"

    with pytest.raises(ValueError, match=r"NoApply does not define apply\(\)"):
        base.register_primitive()(NoApply)

    class Nameless(base.Primitive):
        @staticmethod
        def apply(sch):
            pass

    with pytest.raises(ValueError, match=r"Nameless does not define name\(\)"):
        base.register_primitive()(Nameless)

    class Shard(base.Primitive):
        @staticmethod
        def name():
            return "shard"

        @staticmethod
        def apply(sch):
            pass

    with pytest.raises(ValueError, match="'shard' is registered twice"):
        base.register_primitive()(Shard)
    assert slapo.get_primitive("shard").__module__ == "slapo.primitives.shard"


def test_upstream_keyword_names_of_shard_replace_and_replace_all():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU())
    sch = slapo.create_schedule(model)
    sch["0"].shard(tensor_name="weight", axis=0)  # one rank: validated, nothing to slice
    sch["1"].replace(new_mod_or_func=nn.GELU())
    assert isinstance(model[1], nn.GELU)
    replaced = sch.replace_all(target_mod_type=nn.ReLU, make_mod_fn=lambda path, mod: nn.Tanh())
    assert replaced == ["3"] and isinstance(model[3], nn.Tanh)
    with pytest.raises(TypeError, match="tensor_name= and param_names= name the same argument"):
        sch["2"].shard(param_names="weight", tensor_name="weight", axis=0)


def _config(name_or_path):
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    config._name_or_path = name_or_path
    return config


def test_apply_schedule_runs_the_steps_registered_for_the_models_short_name(fresh_registries):
    calls = []

    @schedule_registry.register_schedule_method("mygpt")
    def shard_parameters(sch, model_config, sch_config):
        calls.append(("shard_parameters", sch.path, sch_config["my_key"]))

    @schedule_registry.register_schedule_method("mygpt")
    def checkpoint(sch, model_config, ckpt_ratio=1.0, checkpoint_method="uniform"):
        calls.append(("checkpoint", sch.path, ckpt_ratio, checkpoint_method))
        sch["h.0"].checkpoint()

    from transformers import GPT2LMHeadModel

    config = _config("me/mygpt-tiny")
    model = GPT2LMHeadModel(config)
    sch = apply_schedule(model, config, prefix="transformer", ckpt_ratio=1.0, my_key=7)
    assert calls == [("shard_parameters", "", 7), ("checkpoint", "transformer", 1.0, "uniform")]
    assert getattr(model.transformer.h[0], "_slapo_checkpointed", False)
    assert schedule_registry.get_schedule_method("mygpt", "checkpoint") is checkpoint
    assert schedule_registry.get_schedule_method("mygpt", "broadcast_input") is None
    assert sch.mod is model
    with pytest.raises(ValueError, match="shard_parameters is already registered for mygpt"):
        schedule_registry.register_schedule_method("mygpt")(shard_parameters)


def test_a_registered_step_asked_for_and_missing_is_an_error(fresh_registries):
    @schedule_registry.register_schedule_method("mygpt")
    def shard_parameters(sch, model_config, sch_config):
        pass

    from transformers import GPT2LMHeadModel

    config = _config("mygpt-tiny")
    with pytest.raises(NotImplementedError,
                       match="ckpt_ratio is 0.5, but no checkpoint is registered for 'mygpt'"):
        apply_schedule(GPT2LMHeadModel(config), config, ckpt_ratio=0.5)
    assert schedule_registry.short_name(_config("EleutherAI/gpt-neo-125M")) == "gpt_neo"
    assert schedule_registry.short_name(_config("")) is None


# A user's schedule file in upstream's last form (its imports made absolute): one function,
# registered under the file's name, given the model and every keyword; RoBERTa's delegates to
# BERT's, as upstream's roberta.py does.
SCHEDULE_FILE = """
from slapo.schedule import create_schedule
from slapo.model_schedule.registry import get_schedule, register_schedule

CALLS = []


@register_schedule()
def _apply_schedule(model, **sch_config):
    CALLS.append(sorted(sch_config))
    if sch_config.get("delegate"):
        sch_config.pop("delegate")
        return get_schedule("bert")(model, **sch_config)
    sch = create_schedule(model, group=sch_config.get("group"))
    sch[sch_config["prefix"] + ".encoder.layer.0"].checkpoint()
    return sch
"""


def _schedule_file(tmp_path, monkeypatch, name):
    import importlib

    (tmp_path / f"{name}.py").write_text(SCHEDULE_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def _tiny_bert(name_or_path="bert-tiny"):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._name_or_path = name_or_path
    return BertForMaskedLM(config).eval(), config


def test_a_schedule_of_upstreams_last_form_is_named_by_its_file(fresh_registries, tmp_path,
                                                                 monkeypatch):
    """upstream's newest registry (register_schedule, get_schedule) and apply_schedule(model,
    schedule_key, model_config=..., **sch_config): before, the registry had neither, and the
    call was a TypeError (two values for model_config)."""
    module = _schedule_file(tmp_path, monkeypatch, "mybert")
    assert schedule_registry.get_schedule("mybert") is module._apply_schedule
    model, config = _tiny_bert()
    sch = apply_schedule(model, "mybert", model_config=config, prefix="bert", my_key=1)
    assert module.CALLS == [["model_config", "my_key", "prefix"]]
    assert sch.mod is model and getattr(model.bert.encoder.layer[0], "_slapo_checkpointed", False)
    # the config's form finds it too, by the model's short name ("mybert-tiny" -> "mybert")
    model, config = _tiny_bert("me/mybert-tiny")
    apply_schedule(model, config, prefix="bert")
    assert len(module.CALLS) == 2
    with pytest.raises(ValueError, match="Schedule method for mybert already exists."):
        schedule_registry.register_schedule()(module._apply_schedule)
    with pytest.raises(ValueError, match="Schedule for nosuch does not exist."):
        apply_schedule(model, "nosuch", model_config=config)
    with pytest.raises(TypeError, match="give the model's config"):
        apply_schedule(model, prefix="bert")


def test_get_schedule_of_a_shipped_family_applies_the_packages_schedule(fresh_registries,
                                                                        tmp_path, monkeypatch):
    """A schedule delegating to get_schedule("bert") (upstream's RoBERTa) gets the package's
    BERT schedule where no file registered one: the same model as apply_schedule's."""
    module = _schedule_file(tmp_path, monkeypatch, "myroberta")
    torch.manual_seed(0)
    model, config = _tiny_bert()
    plain = apply_schedule(_clone(model), config, prefix="bert")
    sch = apply_schedule(model, "myroberta", model_config=config, prefix="bert", delegate=True)
    assert module.CALLS == [["delegate", "model_config", "prefix"]]
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    got, want = slapo.build_module(sch)(**batch).loss, slapo.build_module(plain)(**batch).loss
    assert torch.equal(got, want)
    assert type(sch["bert.encoder.layer.0.attention.self"].mod) is \
        type(plain["bert.encoder.layer.0.attention.self"].mod)
    with pytest.raises(ValueError, match="the schedule of bert given schedule_key='gpt2'"):
        schedule_registry.get_schedule("bert")(model, schedule_key="gpt2")


def _clone(model):
    import copy

    return copy.deepcopy(model)


def test_upstream_module_paths():
    from slapo.env import cleanup, execute, setup
    from slapo.initialization import init_empty_weights
    from slapo.utils import report_memory

    assert (slapo.setup, slapo.execute, slapo.cleanup) == (setup, execute, cleanup)
    assert init_empty_weights is slapo.init_empty_weights
    assert "cpu_peak_gib" in report_memory("test")


def test_tracer_trace_gives_the_graph_module():
    from slapo.tracer import trace

    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = model(x)
    gm = trace(model, flatten=True)
    assert isinstance(gm, fx.GraphModule)
    assert [n.op for n in gm.graph.nodes].count("call_module") == 3
    torch.testing.assert_close(gm(x), expected)
