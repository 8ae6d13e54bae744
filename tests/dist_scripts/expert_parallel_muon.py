"""Trainer with Per-Head Muon and Quantile Balancing on a model loaded with expert parallelism 2 x FSDP 2.

Launched as ``torchrun --nproc_per_node 4 tests/dist_scripts/expert_parallel_muon.py WORK`` (repository root on
PYTHONPATH) with ``WORK/initial`` a saved tiny model: every rank loads it with
``DistributedConfig(fsdp_size=4, ep_size=2)`` (the experts on a 2 x 2 mesh, 2 of the 8 per rank; everything else
FSDP2-sharded over the 4 ranks) and trains ``STEPS`` steps through ``KimiK3Trainer``. Around every Per-Head Muon step
a callback records, before it, every parameter and gradient whole (for the single-process replay in the test) and, inside
it, this rank's matmul FLOPs, the bytes its collectives receive and the bytes of the largest tensor any operation
creates on this rank (local shards of DTensors). Rank 0 writes everything to ``WORK/expert_parallel_muon.pt``.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import TrainerCallback, TrainingArguments, default_data_collator

from kimi_k3.attachments.handle import unwrapped_optimizer
from kimi_k3.parallel.sharding import sharded_loading_config
from kimi_k3.optim.muon import PerHeadMuonFactory
from kimi_k3.planning.verify import CollectivePayload
from kimi_k3.policies.quantile_balancing import QuantileBalancingCallback
from kimi_k3.job.trainer import KimiK3Trainer
from modeling_kimi_k3 import KimiK3ForCausalLM

WORLD_SIZE, EXPERT_PARALLEL = 4, 2
STEPS = 3
SEQUENCE_LENGTH = 16
LEARNING_RATE = 1e-2


class LargestTensor(TorchDispatchMode):
    """Bytes of the largest tensor an operation creates on this rank (a DTensor counts its local shard)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                self.largest = max(self.largest, local.numel() * local.element_size())
        return out


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor), on every rank."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class OptimizerStepRecorder(TrainerCallback):
    """Records around Per-Head Muon's own update: through the optimizer's step hooks, registered before those of
    the policies (listed after this callback), which update inside ``optimizer.step()`` too and whose collectives
    are not Newton–Schulz traffic."""

    def __init__(self):
        self.steps = []
        self._modes = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = unwrapped_optimizer(optimizer)
        inner.register_step_pre_hook(lambda stepped, hook_args, hook_kwargs: self._before_step(model))
        inner.register_step_post_hook(lambda stepped, hook_args, hook_kwargs: self._after_step(model))

    def _before_step(self, model):
        self.steps.append({
            "params": {name: whole(p) for name, p in model.named_parameters()},
            "grads": {name: whole(p.grad) for name, p in model.named_parameters() if p.grad is not None},
        })
        self._modes = (FlopCounterMode(display=False), CollectivePayload(), LargestTensor())
        for mode in self._modes:
            mode.__enter__()

    def _after_step(self, model):
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        flops, collectives, largest = self._modes
        self.steps[-1].update(flops=flops.get_total_flops(), received=collectives.received, given=collectives.payload,
                              largest_tensor=largest.largest)
        self.steps[-1]["after"] = {name: whole(p) for name, p in model.named_parameters()}


def main(work: Path) -> None:
    dist.init_process_group("gloo")
    model = KimiK3ForCausalLM.from_pretrained(
        work / "initial", distributed_config=sharded_loading_config(WORLD_SIZE, EXPERT_PARALLEL)
    ).train()
    experts = model.model.layers[1].block_sparse_moe.experts.gate_up_proj
    layout = (tuple(experts.device_mesh.mesh.shape), tuple(experts.placements), tuple(experts.to_local().shape))
    tokens = torch.randint(model.config.vocab_size, (STEPS * WORLD_SIZE, SEQUENCE_LENGTH),
                           generator=torch.Generator().manual_seed(0))
    # A constant learning rate and no gradient clipping: the replay steps with the recorded gradients as they are.
    args = TrainingArguments(output_dir=str(work / "run"), per_device_train_batch_size=1, max_steps=STEPS,
                             learning_rate=LEARNING_RATE, weight_decay=0.1, lr_scheduler_type="constant",
                             logging_steps=1, save_strategy="no", seed=0, max_grad_norm=0, use_cpu=True,
                             report_to="none", disable_tqdm=True)
    recorder = OptimizerStepRecorder()
    factory, optimizer_kwargs = PerHeadMuonFactory.from_training_args(args)
    trainer = KimiK3Trainer(
        model=model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in tokens],
        data_collator=default_data_collator, optimizer_cls_and_kwargs=(factory, optimizer_kwargs),
        callbacks=[recorder, QuantileBalancingCallback(model, per_layer_metrics=False)],
    )
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    per_rank = {key: [step[key] for step in recorder.steps] for key in ("flops", "received", "given", "largest_tensor")}
    gathered = [None] * WORLD_SIZE
    plans, rank = optimizer.newton_schulz_plans(), dist.get_rank()
    dist.all_gather_object(gathered, {**per_rank, "layout": layout, "ns_itemsize": optimizer.ns_dtype.itemsize,
                                      "planned_call_flops": sum(plan.call_flops(rank) for plan in plans),
                                      "planned_block_flops": sum(plan.flops_per_rank()[rank] for plan in plans)})
    if dist.get_rank() == 0:
        steps = [{key: step[key] for key in ("params", "grads", "after")} for step in recorder.steps]
        torch.save({"ranks": gathered, "steps": steps, "optimizer_kwargs": optimizer_kwargs},
                   work / "expert_parallel_muon.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
