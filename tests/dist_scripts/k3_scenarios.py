"""Training scenarios run both in one process (the references, from the tests) and in 2 launched processes.

Launched as ``accelerate launch --config_file configs/accelerate_ddp.yaml tests/dist_scripts/k3_scenarios.py WORK
NS_DTYPE`` (repository root on PYTHONPATH; ``NS_DTYPE`` is Per-Head Muon's Newton–Schulz precision, ``bfloat16`` or
``float32``), every rank runs :func:`main`: DDP through ``Trainer``, a DDP resume of the single-process checkpoint,
Quantile Balancing statistics, a raw FSDP2 loop, and ``Trainer`` on models sharded by transformers at load time
(FSDP2, then FSDP2 with expert parallelism), all with Per-Head Muon and QK-Clip. Rank 0
writes the results to ``WORK/distributed.pt``. The tests put ``config.json``, the initial model (``initial/``) and
the single-process checkpoints into ``WORK`` first.

Every scenario splits one global batch of ``GLOBAL_BATCH`` sequences per step into ``MICRO_BATCH``-sequence
micro-batches, consumed by ranks (DDP, FSDP) or accumulated in one process. Both then compute the same
per-micro-batch gradients and add them in the same order, so the runs agree bitwise (see test_distributed.py).
"""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainingArguments, default_data_collator

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.parallel.sharding import (
    full_state_dict,
    load_full_state_dict,
    save_pretrained_full,
    shard_decoder_layers,
    sharded_loading_config,
)
from kimi_k3.attachments.seams import find_routers
from kimi_k3.job.trainer import KimiK3Trainer
from kimi_k3.optim.muon import PerHeadMuon, PerHeadMuonFactory
from kimi_k3.policies.qk_clip import QKClip, QKClipCallback
from kimi_k3.policies.quantile_balancing import (
    QuantileBalancing,
    QuantileBalancingCallback,
    all_reduce_sum,
)
from kimi_k3.quantization.qat import attach_qat
from modeling_kimi_k3 import KimiK3ForCausalLM

WORLD_SIZE = 2
MICRO_BATCH = 2
GLOBAL_BATCH = WORLD_SIZE * MICRO_BATCH
SEQUENCE_LENGTH = 16
STEPS = 4
SAVE_STEPS = 2
LEARNING_RATE = 1e-2
# Between the test model's per-head max logits (about 0.013-0.032): QK-Clip rescales some heads and leaves others.
QK_CLIP_TAU = 0.02


# ---------------------------------------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------------------------------------
def build_model(config: KimiK3Config) -> KimiK3ForCausalLM:
    torch.manual_seed(0)
    return KimiK3ForCausalLM(config).train()


def qat_config(config: KimiK3Config) -> KimiK3Config:
    """The test model with expert input widths that MXFP4 can group (multiples of 32), for QAT."""
    qat = copy.deepcopy(config)
    qat.routed_expert_hidden_size = qat.moe_intermediate_size = 32
    return qat


def build_qat_model(config: KimiK3Config) -> KimiK3ForCausalLM:
    model = build_model(qat_config(config))
    attach_qat(model)
    return model


def token_sequences(config: KimiK3Config) -> torch.Tensor:
    """STEPS global batches of random tokens, [STEPS * GLOBAL_BATCH, SEQUENCE_LENGTH]."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(config.vocab_size, (STEPS * GLOBAL_BATCH, SEQUENCE_LENGTH), generator=generator)


def micro_batches(config: KimiK3Config, ranks=range(WORLD_SIZE)) -> list[list[torch.Tensor]]:
    """Per step, the micro-batches of ``ranks``: micro-batch ``i`` of a step is rank ``i``'s share of it."""
    steps = token_sequences(config).view(STEPS, WORLD_SIZE, MICRO_BATCH, SEQUENCE_LENGTH)
    return [[step[rank] for rank in ranks] for step in steps]


def router_biases(model) -> torch.Tensor:
    return torch.stack([router.e_score_correction_bias for router in find_routers(model).values()]).clone()


def assert_replicated(tensor: torch.Tensor, what: str) -> None:
    """Every rank holds bitwise the same ``tensor`` (no-op in one process)."""
    if not dist.is_initialized():
        return
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    for rank, other in enumerate(gathered):
        if not torch.equal(other, tensor):
            raise AssertionError(f"{what} differs between rank {dist.get_rank()} and rank {rank}")


# ---------------------------------------------------------------------------------------------------------------------
# Trainer (DDP when launched on several processes)
# ---------------------------------------------------------------------------------------------------------------------
class StepRecorder(TrainerCallback):
    """Losses, gradient norms, this rank's max MLA logits (read from ``clipping``'s policy before the step clips) and
    the router biases of every optimizer step, which Quantile Balancing solved in the optimizer's step hook; checks
    that every rank ends the step with the same bias."""

    def __init__(self, clipping: QKClipCallback):
        self.clipping = clipping
        self.losses, self.grad_norms, self.logit_maxima, self.biases = [], [], [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        recorders = [recorder for _, recorder in self.clipping.policy.recorders.values()]
        self.logit_maxima.append(torch.stack([recorder.maximum for recorder in recorders]).clone())

    def on_step_end(self, args, state, control, model=None, **kwargs):
        biases = router_biases(model)
        assert_replicated(biases, f"router bias after step {state.global_step}")
        self.biases.append(biases)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.losses.append(logs["loss"])
            self.grad_norms.append(logs["grad_norm"])


def train_with_trainer(
    config,
    output_dir,
    *,
    ns_dtype,
    gradient_accumulation_steps,
    micro_batch=MICRO_BATCH,
    model=None,
    save_steps=SAVE_STEPS,
    resume_from_checkpoint=None,
    max_grad_norm=1.0,
) -> dict:
    """Per-Head Muon with QK-Clip and Quantile Balancing through ``Trainer`` for STEPS steps; ``save_steps=None``
    saves nothing, ``max_grad_norm=0`` clips no gradient (``Trainer`` still computes and logs the norm).
    ``ns_dtype`` is Newton–Schulz's precision, forced rather than picked from the CPU: both paths, every machine.

    ``Trainer`` normalizes the loss by the label count of the whole global batch (over micro-batches and ranks),
    and DDP averages what each rank's ``world_size``-scaled loss gives: both add up to the same gradient. ``model``
    defaults to :func:`build_model`; a model sharded at load time trains through the same optimizer factory.
    """
    sequences = token_sequences(config)
    model = build_model(config) if model is None else model.train()
    sharded = getattr(model, "is_distributed_loading_by_transformers", False)
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_steps=STEPS,
        learning_rate=LEARNING_RATE,
        logging_steps=1,
        save_strategy="no" if save_steps is None else "steps",
        save_steps=save_steps or STEPS,
        seed=0,
        max_grad_norm=max_grad_norm,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        ddp_broadcast_buffers=False,
        # Layer 0's self-attention AttnRes projection and norm have no earlier block to weigh: never in the graph.
        ddp_find_unused_parameters=True,
    )
    clipping = QKClipCallback(QK_CLIP_TAU)
    recorder = StepRecorder(clipping)
    trainer = KimiK3Trainer(
        model=model,
        args=args,
        train_dataset=[{"input_ids": row, "labels": row} for row in sequences],
        data_collator=default_data_collator,
        optimizer_cls_and_kwargs=(PerHeadMuonFactory, {"lr": LEARNING_RATE, "weight_decay": 0.1, "ns_dtype": ns_dtype}),
        callbacks=[clipping, QuantileBalancingCallback(model, per_layer_metrics=False), recorder],
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return {
        "world_size": args.world_size,
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "logit_maxima": torch.stack(recorder.logit_maxima),
        "biases": torch.stack(recorder.biases),
        "state": full_state_dict(model) if sharded else {name: t.clone() for name, t in model.state_dict().items()},
    }


def train_sharded_at_load_time(config, work: Path, ns_dtype: str, expert_parallel_size: int = 1) -> dict:
    """``Trainer`` on the initial model loaded FSDP2-sharded over all ranks (experts split ``expert_parallel_size``
    ways), with the optimizer factory and QK-Clip of the unsharded runs, clipping no gradient.

    The global gradient norm of a sharded model is summed from every rank's shard of every gradient, in another order
    than the whole tensors of one process, and may differ from it in the last bit; clipping would then scale every
    gradient by a factor that differs in the last bit (see test_distributed.py).
    """
    model = KimiK3ForCausalLM.from_pretrained(
        work / "initial", distributed_config=sharded_loading_config(WORLD_SIZE, expert_parallel_size)
    )
    experts = model.model.layers[1].block_sparse_moe.experts
    local_experts = experts.gate_up_proj.to_local().shape[0]
    output_dir = work / f"sharded_ep{expert_parallel_size}"
    result = train_with_trainer(
        config, output_dir, ns_dtype=ns_dtype, gradient_accumulation_steps=1, model=model, save_steps=None,
        max_grad_norm=0,
    )
    return {**result, "local_experts": local_experts}


# ---------------------------------------------------------------------------------------------------------------------
# Raw loop (FSDP2 when the model is sharded)
# ---------------------------------------------------------------------------------------------------------------------
def train_raw(model, optimizer, steps: list[list[torch.Tensor]]) -> dict:
    """One optimizer step, with QK-Clip and Quantile Balancing from its step hooks, per entry of ``steps`` (this
    process's micro-batches).

    Each micro-batch loss is a mean over its tokens divided by the number of micro-batches, the division by the
    number of ranks being FSDP's gradient average: the gradient of the global-batch mean either way.
    """
    QKClip(model, QK_CLIP_TAU).attach(optimizer)
    QuantileBalancing(model).attach(optimizer)
    losses, biases = [], []
    for batches in steps:
        loss = torch.zeros(())
        for input_ids in batches:
            micro_loss = model(input_ids=input_ids, labels=input_ids).loss / len(batches)
            micro_loss.backward()
            loss += micro_loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        biases.append(router_biases(model))
        assert_replicated(biases[-1], f"router bias after step {len(biases)}")
        losses.append(loss.item())
    return {"losses": losses, "biases": torch.stack(biases)}


def train_single_process_raw(config, ns_dtype: str, model=None) -> dict:
    model = build_model(config) if model is None else model
    optimizer = PerHeadMuon.for_model(model, lr=LEARNING_RATE, ns_dtype=ns_dtype)
    result = train_raw(model, optimizer, micro_batches(config))
    return {**result, "state": model.state_dict()}


def train_fully_sharded(config, save_directory, ns_dtype: str, model=None) -> dict:
    """FSDP2 per decoder layer over all ranks, each rank training on its own micro-batch of every step."""
    model = shard_decoder_layers(build_model(config) if model is None else model)
    shapes = {name: (tuple(param.to_local().shape), tuple(param.shape)) for name, param in model.named_parameters()}
    optimizer = PerHeadMuon.for_model(model, lr=LEARNING_RATE, ns_dtype=ns_dtype)
    result = train_raw(model, optimizer, micro_batches(config, ranks=[dist.get_rank()]))
    save_pretrained_full(model, save_directory)
    return {**result, "state": full_state_dict(model), "local_and_full_shapes": shapes}


def load_into_fully_sharded(config, checkpoint: Path) -> dict:
    """The full state dict of a freshly sharded model after loading a single-process checkpoint into it."""
    model = shard_decoder_layers(build_model(config))
    load_full_state_dict(model, KimiK3ForCausalLM.from_pretrained(checkpoint).state_dict())
    return full_state_dict(model)


def load_through_trainer_into_sharded_at_load_time(work: Path, checkpoint: Path) -> dict:
    """The full state dict of a model sharded at load time after ``KimiK3Trainer`` loaded a single-process checkpoint
    into it, as resuming and ``load_best_model_at_end`` do."""
    model = KimiK3ForCausalLM.from_pretrained(work / "initial", distributed_config=sharded_loading_config(WORLD_SIZE))
    args = TrainingArguments(output_dir=str(work / "sharded_loaded"), use_cpu=True, report_to="none",
                             save_strategy="no")
    KimiK3Trainer(model=model, args=args)._load_from_checkpoint(str(checkpoint))
    return full_state_dict(model)


# ---------------------------------------------------------------------------------------------------------------------
# Quantile Balancing statistics
# ---------------------------------------------------------------------------------------------------------------------
def pooled_histograms_and_bias(config, batches: list[torch.Tensor]) -> dict:
    """Training forwards over ``batches``, then this process's histograms, the pooled ones and the solved bias."""
    model = build_model(config)
    balancing = QuantileBalancing(model)
    balancing.attach()
    for input_ids in batches:
        model(input_ids=input_ids)
    local = torch.stack([stats.histogram for stats in balancing.statistics.values()]).clone()
    (pooled,) = all_reduce_sum([local])
    balancing.update()
    return {"local": local, "pooled": pooled, "bias": router_biases(model)}


# ---------------------------------------------------------------------------------------------------------------------
# Launched entry point
# ---------------------------------------------------------------------------------------------------------------------
def main(work: Path, ns_dtype: str) -> None:
    config = KimiK3Config.from_json_file(work / "config.json")
    ddp = train_with_trainer(config, work / "ddp", ns_dtype=ns_dtype, gradient_accumulation_steps=1)
    if ddp["world_size"] != WORLD_SIZE or dist.get_world_size() != WORLD_SIZE:
        raise RuntimeError(f"expected {WORLD_SIZE} processes, Trainer saw world_size={ddp['world_size']}")
    rank = dist.get_rank()
    assert_replicated(torch.cat([tensor.flatten().float() for tensor in ddp["state"].values()]), "DDP weights")
    resumed = train_with_trainer(
        config, work / "ddp_resumed", ns_dtype=ns_dtype, gradient_accumulation_steps=1,
        resume_from_checkpoint=str(work / "single" / f"checkpoint-{SAVE_STEPS}"),
    )
    # Two micro-batches per rank: the first two steps' shares of this rank.
    balancing = pooled_histograms_and_bias(config, [step[0] for step in micro_batches(config, ranks=[rank])[:2]])
    fsdp = train_fully_sharded(config, work / "fsdp_model", ns_dtype)
    fsdp_loaded = load_into_fully_sharded(config, work / "single" / f"checkpoint-{STEPS}")
    sharded_at_load = train_sharded_at_load_time(config, work, ns_dtype)
    sharded_loaded = load_through_trainer_into_sharded_at_load_time(work, work / "single" / f"checkpoint-{STEPS}")
    expert_parallel = train_sharded_at_load_time(config, work, ns_dtype, expert_parallel_size=WORLD_SIZE)
    qat = qat_config(config)
    ddp_qat = train_with_trainer(
        qat, work / "ddp_qat", ns_dtype=ns_dtype, gradient_accumulation_steps=1, model=build_qat_model(config),
        save_steps=None,
    )
    fsdp_qat = train_fully_sharded(qat, work / "fsdp_qat_model", ns_dtype, model=build_qat_model(config))
    if rank == 0:
        results = {"ddp": ddp, "ddp_resumed": resumed, "balancing": balancing, "fsdp": fsdp, "fsdp_loaded": fsdp_loaded,
                   "sharded_at_load": sharded_at_load, "sharded_loaded": sharded_loaded,
                   "expert_parallel": expert_parallel, "ddp_qat": ddp_qat, "fsdp_qat": fsdp_qat}
        torch.save(results, work / "distributed.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
