"""Check a :mod:`kimi_k3.parallel_plan` against the real sharding, on the meta device, in one process.

The model is built on the meta device (no memory for its weights), torch's fake process group stands in for
``world_size`` ranks (this process is rank 0; collectives return at once), and the project's own code shards it:
:func:`kimi_k3.distributed.shard_decoder_layers` (what accelerate's FSDP2 plugin does) or transformers' load-time
sharding, ``maybe_distribute_model`` with ``DistributedConfig(fsdp_size, ep_size)`` and
``KimiK3Config.base_model_ep_plan`` (what ``from_pretrained(distributed_config=...)`` does before reading weights).
Gradients are given, shaped like their parameters as FSDP2's reduce-scatter leaves them, to exactly the parameters
a real backward reaches (found by one backward of a narrow model with the same layer pattern), and one optimizer
step of :class:`kimi_k3.muon.PerHeadMuon` or ``torch.optim.AdamW`` allocates the optimizer state. What rank 0 then
holds is counted in elements.
"""

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_k3.distributed import shard_decoder_layers, sharded_loading_config
from kimi_k3.muon import PerHeadMuon
from kimi_k3.parallel_plan import DEFAULT_LORA_TARGETS, ElementCounts, Layout, Setup, validate
from modeling_kimi_k3 import KimiK3ForCausalLM

SHARDING_PATHS = ("accelerate", "transformers")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_STATE_FIELDS = {"momentum_buffer": "muon_momentum", "exp_avg": "adamw_exp_avg", "exp_avg_sq": "adamw_exp_avg_sq",
                 "step": "adamw_steps"}
_COLLECTIVES = ("all_gather", "allgather", "all_reduce", "allreduce", "reduce_scatter", "all_to_all", "alltoall",
                "broadcast")
# c10d ops whose first argument is the output buffer: the input is the second.
_INPUT_SECOND = ("c10d::_allgather_base_", "c10d::allgather_", "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_",
                 "c10d::alltoall_base_", "c10d::alltoall_")


class CollectivePayload(TorchDispatchMode):
    """Bytes of the tensors this rank hands to torch.distributed collectives, c10d and functional (DTensor's); a
    functional collective's own c10d call is not counted again. Works under the fake process group too."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        namespace, _, op = name.partition("::")
        if namespace not in ("c10d", "_c10d_functional") or not any(kind in op for kind in _COLLECTIVES):
            return func(*args, **(kwargs or {}))
        if self._depth == 0:
            given = args[1] if name in _INPUT_SECOND else args[0]
            self.calls.append((name, sum(t.numel() * t.element_size() for t in _tensors(given))))
        self._depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._depth -= 1

    @property
    def payload(self) -> int:
        return sum(size for _, size in self.calls)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    else:
        for item in value:
            yield from _tensors(item)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """torch.distributed initialised as rank ``rank`` of ``world_size`` with the fake backend (no other processes)."""
    if dist.is_initialized():
        raise RuntimeError("verifying a plan needs its own fake process group; torch.distributed is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def default_sharding_path(layout: Layout) -> str:
    """Expert parallelism exists only in transformers' load-time sharding; plain FSDP2 goes through our own."""
    return "transformers" if layout.ep > 1 else "accelerate"


def build_model(config, setup: Setup, device: str):
    """``KimiK3ForCausalLM`` in training mode; with LoRA, peft's adapters on the attention projections. The model gets
    its own copy of ``config``: load-time sharding records the distributed setup in the model's config."""
    with torch.device(device):
        model = KimiK3ForCausalLM(copy.deepcopy(config)).train()
    if setup.lora_rank:
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(LoraConfig(r=setup.lora_rank, target_modules=list(DEFAULT_LORA_TARGETS)), model)
    return model


def parameters_reached_by_backward(config, setup: Setup) -> set[str]:
    """Names of the trainable parameters one training backward gives a gradient, from a narrow copy of ``config``
    (same layers, layer types and options; tiny widths) run for real on the CPU."""
    narrow = narrow_config(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: several threads only contend (10x slower on a busy machine)
    try:
        torch.manual_seed(0)
        model = build_model(narrow, setup, "cpu")
        for p in model.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
        input_ids = torch.randint(narrow.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    finally:
        torch.set_num_threads(threads)
    return {name for name, p in model.named_parameters() if p.grad is not None}


def narrow_config(config):
    """``config`` with every width shrunk; the layer pattern, which projections exist and the switches are kept."""
    values = config.to_dict()
    values.update(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                  qk_nope_head_dim=8, qk_rope_head_dim=4 if config.qk_rope_head_dim else 0, v_head_dim=8,
                  kv_lora_rank=16, q_lora_rank=None if config.q_lora_rank is None else 16,
                  dtype="float32")
    values["linear_attn_config"] = {**config.linear_attn_config, "num_heads": 2, "head_dim": 8}
    if config.num_experts is not None:
        top_k = min(config.num_experts_per_token, 2)
        values.update(num_experts=top_k + 2, num_experts_per_token=top_k, moe_intermediate_size=8,
                      routed_expert_hidden_size=None if config.routed_expert_hidden_size is None else 16)
        values.update(_narrow_variant_fields(config, values["num_experts"], top_k))
    for key in ("layer_types", "mlp_layer_types", "auto_map", "architectures", "model_type", "transformers_version"):
        values.pop(key, None)
    return type(config)(**values)


def _narrow_variant_fields(config, num_experts: int, top_k: int) -> dict:
    """The variant sizes that still fit ``num_experts`` narrowed experts (two-level routing: two groups of k + 1)."""
    values = {}
    if config.expert_basis_size is not None:
        values["expert_basis_size"] = min(config.expert_basis_size, num_experts)
    if config.num_coarse_experts is not None:
        values.update(num_experts=2 * (top_k + 1), num_coarse_experts=2, coarse_experts_per_token=1)
    if config.dynamic_experts_per_token:
        values.update(min_experts_per_token=1, max_experts_per_token=num_experts)
    return values


def shard(model, layout: Layout, path: str):
    if path == "accelerate":
        return shard_decoder_layers(model)
    distributed_config, _, mesh_manager = KimiK3ForCausalLM.prepare_distribute_model(
        sharded_loading_config(layout.fsdp, layout.ep)
    )
    return KimiK3ForCausalLM.maybe_distribute_model(model, distributed_config, mesh_manager)


def build_optimizer(model, setup: Setup):
    if setup.optimizer == "muon":
        return PerHeadMuon.for_model(model, ns_dtype=NS_DTYPES[setup.ns_dtype])
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def local_numel(tensor) -> int:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()


def sharded_counts(config, layout: Layout, setup: Setup, path: str | None = None) -> tuple[ElementCounts, CollectivePayload]:
    """What rank 0 holds after the real sharding and one optimizer step (elements), and what that step handed to
    collectives."""
    validate(config, layout, setup)
    path = path or default_sharding_path(layout)
    if path not in SHARDING_PATHS:
        raise ValueError(f"`path` must be one of {SHARDING_PATHS}, got {path!r}.")
    if path == "accelerate" and layout.ep > 1:
        raise ValueError("`path` 'accelerate' (shard_decoder_layers) has no expert parallelism; use 'transformers'.")
    reached = parameters_reached_by_backward(config, setup)
    with fake_process_group(layout.world_size):
        model = shard(build_model(config, setup, "meta"), layout, path)
        updated = [p for name, p in model.named_parameters() if p.requires_grad and name in reached]
        for p in updated:
            p.grad = torch.zeros_like(p)
        optimizer = build_optimizer(model, setup)
        with CollectivePayload() as sent:
            optimizer.step()
        return held_counts(model, optimizer), sent


def held_counts(model, optimizer) -> ElementCounts:
    """Elements this rank holds: its parameter and gradient shards, optimizer state and buffers."""
    state = dict.fromkeys(_STATE_FIELDS.values(), 0)
    for per_param in optimizer.state.values():
        for key, tensor in per_param.items():
            state[_STATE_FIELDS[key]] += local_numel(tensor)
    return ElementCounts(
        parameters=sum(local_numel(p) for p in model.parameters()),
        gradients=sum(local_numel(p.grad) for p in model.parameters() if p.grad is not None),
        buffers=sum(local_numel(b) for b in model.buffers()),
        **state,
    )
