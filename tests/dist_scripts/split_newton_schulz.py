"""Per-Head Muon steps on the same gradients in one process (the reference) and on every rank of a launched group.

Launched as ``torchrun --nproc_per_node 2 tests/dist_scripts/split_newton_schulz.py WORK`` (repository root on
PYTHONPATH): every rank runs :func:`main`, which steps, for each run of ``WORK/runs.json`` (a ``WORK/<name>.json``
configuration, Newton–Schulz's precision, layouts), a copy of the model in each layout (replicated as under DDP;
FSDP2 per decoder layer; transformers' sharding with expert parallelism, ``ep``, or tensor parallelism, ``tp``) on
gradients that are a function of the parameter name and the step alone, counting each rank's matmul FLOPs and the
bytes it exchanges with the other ranks inside ``optimizer.step()``; rank 0 writes the final weights and the counts to
``WORK/split.pt``. Only the optimizer runs: the gradients stand in for what a backward would leave, without its cost.
"""

import contextlib
import json
import sys
import zlib
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.flop_counter import FlopCounterMode
from transformers.distributed import DistributedConfig

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.parallel.sharding import full_state_dict, shard_decoder_layers
from kimi_k3.optim.muon import PerHeadMuon
from modeling_kimi_k3 import KimiK3ForCausalLM

STEPS = 3
LEARNING_RATE = 1e-2
# transformers' sharding of the in-memory model, as from_pretrained(distributed_config=...) does while loading.
TRANSFORMERS_LAYOUTS = {"ep": DistributedConfig(fsdp_size=2, ep_size=2), "tp": DistributedConfig(tp_size=2)}


def build_model(config: KimiK3Config) -> KimiK3ForCausalLM:
    torch.manual_seed(0)
    return KimiK3ForCausalLM(config)


def set_gradients(model, step: int) -> None:
    """Gradient of every parameter at ``step``: seeded by name and step, the same in every process."""
    for name, param in model.named_parameters():
        generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
        grad = torch.randn(param.shape, generator=generator)
        if isinstance(param, DTensor):
            grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
        param.grad = grad


@contextlib.contextmanager
def counted_traffic(traffic: list[int]):
    """Adds to ``traffic`` [sent, received] the bytes this rank exchanges with other ranks through all-to-all and
    all-gather (ring all-gather: each rank sends and receives every other rank's share once)."""
    all_to_all_single, all_gather = dist.all_to_all_single, dist.all_gather

    def counting_all_to_all(output, input, output_split_sizes, input_split_sizes, group=None):
        rank = dist.get_rank(group)
        traffic[0] += (sum(input_split_sizes) - input_split_sizes[rank]) * input.element_size()
        traffic[1] += (sum(output_split_sizes) - output_split_sizes[rank]) * output.element_size()
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)

    def counting_all_gather(tensor_list, tensor, group=None):
        others = (len(tensor_list) - 1) * tensor.numel() * tensor.element_size()
        traffic[0] += others
        traffic[1] += others
        return all_gather(tensor_list, tensor, group=group)

    with mock.patch.object(dist, "all_to_all_single", counting_all_to_all), \
            mock.patch.object(dist, "all_gather", counting_all_gather):
        yield


def run_steps(model, ns_dtype: str, counted: bool = True) -> dict:
    """STEPS optimizer steps (momentum carries over): per step, the matmul FLOPs and the traffic of this process, and
    the traffic the optimizer's own plans give this rank. ``counted=False`` steps outside the FLOP counter's dispatch
    mode, under which Per-Head Muon's compiled elementwise passes run eagerly, so that they run compiled."""
    optimizer = PerHeadMuon.for_model(model, lr=LEARNING_RATE, ns_dtype=ns_dtype)
    flops, traffic = [], []
    for step in range(STEPS):
        set_gradients(model, step)
        traffic.append([0, 0])
        with contextlib.ExitStack() as counting:
            if counted:
                counter = counting.enter_context(FlopCounterMode(display=False))
                counting.enter_context(counted_traffic(traffic[-1]))
            optimizer.step()
        flops.append(counter.get_total_flops() if counted else None)
        optimizer.zero_grad()
    itemsize = optimizer.ns_dtype.itemsize
    rank = dist.get_rank() if dist.is_initialized() else 0
    plans = optimizer.newton_schulz_plans()
    planned = [sum(plan.exchange_bytes(itemsize)[rank][i] for plan in plans) for i in (0, 1)]
    return {"flops": flops, "traffic": [tuple(pair) for pair in traffic], "planned_traffic": tuple(planned),
            "planned_flops": sum(plan.call_flops(rank) for plan in plans), "ns_itemsize": itemsize}


def single_process(config: KimiK3Config, ns_dtype: str) -> dict:
    model = build_model(config)
    result = run_steps(model, ns_dtype)
    return {"flops": result["flops"], "state": model.state_dict()}


def distributed_layout(config: KimiK3Config, layout: str, ns_dtype: str, counted: bool = True) -> dict:
    model = build_model(config)
    if layout == "fsdp2":
        shard_decoder_layers(model)
    elif layout in TRANSFORMERS_LAYOUTS:
        distributed_config, _, mesh = KimiK3ForCausalLM.prepare_distribute_model(TRANSFORMERS_LAYOUTS[layout])
        model = KimiK3ForCausalLM.maybe_distribute_model(model, distributed_config, mesh)
    result = run_steps(model, ns_dtype, counted)
    gathered = {key: [None] * dist.get_world_size() for key in ("flops", "traffic", "planned_traffic", "planned_flops")}
    for key, values in gathered.items():
        dist.all_gather_object(values, result[key])
    state = model.state_dict() if layout == "ddp" else full_state_dict(model)
    return {"flops_per_rank": gathered["flops"], "bytes_per_rank": gathered["traffic"],
            "planned_bytes_per_rank": gathered["planned_traffic"], "planned_flops_per_rank": gathered["planned_flops"],
            "state": state, "ns_itemsize": result["ns_itemsize"]}


def refusal_of_rank_dependent_updates(config: KimiK3Config) -> str:
    """The error a step raises when plain parameters, taken as replicated, get different gradients on each rank."""
    model = build_model(config)
    optimizer = PerHeadMuon.for_model(model, lr=LEARNING_RATE)
    set_gradients(model, step=dist.get_rank())
    try:
        optimizer.step()
    except ValueError as error:
        return str(error)
    return ""


def main(work: Path) -> None:
    dist.init_process_group("gloo")
    results = {}
    for run, spec in json.loads((work / "runs.json").read_text()).items():
        config = KimiK3Config.from_json_file(work / f"{spec['config']}.json")
        results[run] = {layout: distributed_layout(config, layout, spec["ns_dtype"]) for layout in spec["layouts"]}
    default = KimiK3Config.from_json_file(work / "default.json")
    results["not counted"] = {layout: distributed_layout(default, layout, "auto", counted=False)["state"]
                              for layout in ("ddp", "fsdp2")}
    results["refusal"] = refusal_of_rank_dependent_updates(config)
    if dist.get_rank() == 0:
        torch.save(results, work / "split.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
