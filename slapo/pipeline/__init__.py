"""Pipeline parallelism from a traced model: ``partition`` cuts the graph into stages
(``split_stages``; upstream Slapo's ``generate_pipeline_partition``), ``runtime`` runs them
(``build_pipeline`` on ``torch.distributed.pipelining``, tied weights across stages,
gradient reduction), and ``deepspeed_pipe`` runs them on DeepSpeed's pipeline engine instead,
as upstream did (``build(sch, target="deepspeed")`` of a cut schedule; imported only then,
since it needs DeepSpeed). The names upstream code reads from ``slapo.pipeline`` are here."""

from .partition import (
    CARRIED,
    from_carrier,
    generate_pipeline_partition,
    pipeline_cuts,
    record_cut,
    shared_parameters,
    split_stages,
    to_carrier,
)
from .runtime import (
    PipelineBuild,
    Tie,
    analyze_tie_ranks,
    analyze_tie_weights,
    build_pipeline,
)

__all__ = ["CARRIED", "PipelineBuild", "Tie", "analyze_tie_ranks", "analyze_tie_weights",
           "build_pipeline", "from_carrier", "generate_pipeline_partition", "pipeline_cuts",
           "record_cut", "shared_parameters", "split_stages", "to_carrier"]
