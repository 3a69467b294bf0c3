"""Slapo: a schedule language for progressive optimization of large deep learning models.

    import slapo
    sch = slapo.create_schedule(model)            # a schedule tree mirroring the model
    sch["encoder.layer.0.attention.self.query"].shard("weight", axis=0)
    sch["encoder.layer.0.attention.self"].sync("bwd_post", "all_reduce")
    model = slapo.build_module(sch)

``slapo.list_primitives()`` lists the primitives; ``help(sch.<primitive>)`` explains one.
"""

from . import framework_dialect, initialization, model_dialect, model_schedule, op, pipeline, tracer
from .autotune import Database, Space, Symbol
from .build import build, build_module, init_empty_weights
from .env import cleanup, execute, setup
from .logger import get_logger
from .pattern import ModulePattern, Pattern, call_module
from .primitives import get_primitive, list_primitives, register_primitive
from .primitives._params import annotations as get_annotations
from .primitives.checkpoint import checkpoint_call as checkpoint
from .primitives.shard import ShardSpec, shard_spec
from .random import get_cuda_rng_tracker, set_random_seed
from .schedule import Schedule, create_schedule
from .topology import Topology
from .verify import Verify

__version__ = "0.1.0"

__all__ = ["Database", "ModulePattern", "Pattern", "Schedule", "ShardSpec", "Space", "Symbol",
           "Topology", "Verify", "build", "build_module", "call_module", "checkpoint",
           "cleanup", "create_schedule", "execute", "get_annotations", "get_cuda_rng_tracker",
           "get_logger", "get_primitive", "init_empty_weights", "list_primitives",
           "register_primitive", "set_random_seed", "setup", "shard_spec",
           # subpackages upstream's users reach as attributes (its tutorials: slapo.op.Print())
           "framework_dialect", "initialization", "model_dialect", "model_schedule", "op",
           "pipeline", "tracer"]
