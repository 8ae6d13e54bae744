"""What one rank of a real 2-process gloo run holds and sends, for the parallelism plan's tests.

Launched as ``torchrun --nproc_per_node 2 tests/dist_scripts/plan_counts.py WORK`` (repository root on PYTHONPATH)
with ``WORK/initial`` a saved default-config model. Two runs, each one training step (forward, backward, optimizer
step, Quantile Balancing update) on one micro-batch per rank:

- ``fsdp``: :func:`kimi_k3.parallel.sharding.shard_decoder_layers`, then Per-Head Muon;
- ``expert_parallel``: ``from_pretrained`` with ``DistributedConfig(fsdp_size=2, ep_size=2)``, then Per-Head Muon.

Rank 0 writes, per run, the elements it holds (parameters, gradients, optimizer state, buffers) and the payload bytes
it handed to collectives during ``optimizer.step()`` and during the Quantile Balancing update, to ``WORK/counts.json``.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kimi_k3.parallel.sharding import shard_decoder_layers, sharded_loading_config
from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.planning.verify import CollectivePayload, held_counts
from kimi_k3.policies.quantile_balancing import QuantileBalancing
from modeling_kimi_k3 import KimiK3ForCausalLM

SEQUENCE_LENGTH = 16


def one_step(model) -> dict:
    """One training step on this rank's micro-batch; what rank 0 then holds and what the optimizer and Quantile
    Balancing sent."""
    balancing = QuantileBalancing(model)
    balancing.attach()
    optimizer = PerHeadMuon.for_model(model, ns_dtype=torch.bfloat16)  # what "auto" picks on GPUs
    generator = torch.Generator().manual_seed(dist.get_rank())
    input_ids = torch.randint(model.config.vocab_size, (1, SEQUENCE_LENGTH), generator=generator)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    with CollectivePayload() as newton_schulz:
        optimizer.step()
    with CollectivePayload() as quantile_balancing:
        balancing.update()
    return {
        "counts": dataclasses.asdict(held_counts(model, optimizer)),
        "newton_schulz": {"payload": newton_schulz.payload, "calls": len(newton_schulz.calls),
                          "ops": sorted({name for name, _ in newton_schulz.calls})},
        "quantile_balancing": {"payload": quantile_balancing.payload, "calls": len(quantile_balancing.calls)},
    }


def main(work: Path) -> None:
    dist.init_process_group("gloo")
    model = KimiK3ForCausalLM.from_pretrained(work / "initial").train()
    results = {"fsdp": one_step(shard_decoder_layers(model))}
    expert_parallel = KimiK3ForCausalLM.from_pretrained(
        work / "initial", distributed_config=sharded_loading_config(dist.get_world_size(), dist.get_world_size())
    ).train()
    results["expert_parallel"] = one_step(expert_parallel)
    if dist.get_rank() == 0:
        (work / "counts.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
