"""cut_pipeline_stage: end a pipeline stage after a module of the traced model."""

from __future__ import annotations

from ..pipeline import record_cut
from . import register_primitive
from .decompose import not_called_reason, traced_owner


@register_primitive()
def cut_pipeline_stage(sch) -> None:
    """End a pipeline stage after this module; the next stage starts with what follows.

    The module must be called from a traced graph (``trace`` an ancestor; for the pipeline
    itself, trace the schedule root: with ``flatten=False`` cuts inside nested graphs are
    fine, the build inlines the graphs on the way). ``slapo.build(sch, target="pipeline",
    n_microbatches=..., loss_fn=...)`` then splits the traced root graph at the cuts, one
    stage per rank, and returns ``(slapo.pipeline.PipelineBuild, None)``, the first holding the
    ``torch.distributed.pipelining`` ``PipelineStage`` and schedule (GPipe by default) that
    run it. Values crossing a cut must be tensors; a parameter must not be used on both sides.

    Example::

        sch.trace(flatten=False, example_inputs={"input_ids": ids, "attention_mask": mask},
                  concrete_args={"use_cache": False})
        sch["bert.encoder.layer.11"].cut_pipeline_stage()      # two stages
        pipe, _ = slapo.build(sch, target="pipeline", init_weights=False, n_microbatches=4,
                              loss_fn=loss_fn)
        losses = pipe.step(ids, mask, target=labels)             # on every rank
    """
    where = sch.path or "<root>"
    if sch.parent is None:
        raise ValueError("cut_pipeline_stage applies to a submodule, not to the whole model")
    if traced_owner(sch) is None:
        raise ValueError(f"cannot cut the pipeline after '{where}' ({type(sch.mod).__name__}): "
                         f"no traced graph calls it; {not_called_reason(sch)}")
    record_cut(sch)
