"""``megatron`` in 3D: megatron-core's own GPT model (GPT-Neo, LLaMA) with its pipeline and
tensor parallelism and data-parallel replicas, for a case with pipeline stages (``pp`` > 1)
or replicas (``tp`` < GPUs / pp).

``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
pipeline_model_parallel_size=pp)`` lays the ranks out (tensor ranks consecutive, replicas
next, stages outermost, as ``slapo.Topology``); each rank builds its stage of the model
(:class:`.megatron.MegatronSystem`'s mapping of the HF config, ``pre_process`` on the first
stage, ``post_process`` on the last), and a step is megatron-core's forward-backward schedule
(``pipeline_parallel.get_forward_backward_func()``: 1F1B over the case's micro-batches, p2p
``isend``/``irecv`` along the pipeline). Megatron-LM's ``finalize_model_grads`` needs its
DDP wrapper (``main_grad`` buffers), which this harness does not use; what it does is done
here after the schedule, with the same groups: the tied word embedding's gradient summed over
``parallel_state.get_embedding_group()`` (first and last stage) and every gradient averaged
over ``get_data_parallel_group()``. AdamW over fp32 parameters under autocast (not in bf16
with master copies, as with TP alone: a pipeline would send bf16 between its stages).

Each replica trains on ``batch / dp`` samples; the step's loss is the mean of the last stage's
micro-batch losses, broadcast along the pipeline. megatron-core divides the layers evenly
over the stages: a layer count that ``pp`` does not divide is ``unsupported``, as are BERT
and T5 with pp > 1 (this harness runs megatron-core's GPT pipeline only) and fp16 (loss
scaling inside the schedule is Megatron-LM's optimizer's, not used here; use bf16). On CPU the
:mod:`.megatron_cpu` adapter runs the build and each schedule with CUDA read as the CPU.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .megatron import MegatronSystem, gpt_forward


class Megatron3DSystem(MegatronSystem):
    mode = "megatron"
    description = ("megatron-core's own GPT model with its pipeline (1F1B) and tensor "
                   "parallelism, data parallel over replicas")

    # -- how the global batch is split --------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.spec.case.dp_size

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def tp_size(self) -> int:
        return self.spec.case.tp_size

    @property
    def pp_size(self) -> int:
        return self.spec.case.pp

    def info(self) -> dict:
        case = self.spec.case
        return {**super().info(), "pp_size": case.pp, "micro_batch": case.micro_batch_size,
                "n_microbatches": case.n_microbatches}  # precision and optimizer as the base's

    def cuda_context(self):
        if self.ctx.device.type == "cpu":
            from . import megatron_cpu

            return megatron_cpu.cuda_as_cpu()
        return super().cuda_context()

    def uses_master_weights(self) -> bool:
        return False  # megatron-core's pipeline schedule runs under autocast (train_step)

    def _config(self, **fields):
        # p2p one transfer at a time: batched p2p ends in torch.cuda.synchronize()
        return super()._config(batch_p2p_comm=False, **fields)

    def setup(self) -> None:
        super().setup()
        case = self.spec.case
        self.notes.append(
            f"megatron-core 3D: {case.dp_size} replicas x {case.pp} stages x {case.tp_size} "
            f"tensor ranks; {case.n_microbatches} micro-batches of {case.micro_batch_size} "
            "per step (get_forward_backward_func); tied-embedding and data-parallel gradient "
            "all-reduces after the schedule (not Megatron-LM's DDP)")

    # -- one step --------------------------------------------------------------------------
    def train_step(self, batch: dict) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        case = self.spec.case
        size = case.micro_batch_size
        micro = [batch["input_ids"][i * size:(i + 1) * size]
                 for i in range(case.n_microbatches)]
        with self.cuda_context(), torch.autocast(self.ctx.device.type,
                                                 dtype=self.autocast_dtype,
                                                 enabled=self.autocast_dtype is not None):
            store = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iter(micro), model=self.model,
                num_microbatches=len(micro), seq_length=case.seq_len, micro_batch_size=size,
                forward_only=False)
        self._reduce_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = (torch.stack([out["lm loss"] for out in store]).mean().float() if store
                else torch.zeros((), device=self.ctx.device))
        dist.broadcast(loss, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
        return loss

    def _reduce_gradients(self) -> None:
        from megatron.core import parallel_state

        model = self.model
        if (self.pp_size > 1 and model.share_embeddings_and_output_weights
                and parallel_state.is_rank_in_embedding_group()):
            weight = model.shared_embedding_or_output_weight()
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())
        if self.dp_size > 1:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
            flat /= self.dp_size
            for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(part.view_as(grad))


def _forward_step(data_iterator, model):
    """megatron-core's ``forward_step_func``: this stage's output and, for the last stage, the
    function that turns its per-token losses into the micro-batch's loss."""
    return gpt_forward(model, next(data_iterator)), _loss


def _loss(per_token: torch.Tensor):
    loss = per_token.float().mean()
    # a copy: the schedule divides the returned loss by the micro-batch count in place
    return loss, {"lm loss": loss.detach().clone()}
