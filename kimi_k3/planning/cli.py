"""Per-rank memory and per-step communication of a Kimi K3 training layout, and whether it fits.

    python scripts/plan_parallel.py --world-size 64 --ep 8 --verify     # the released 2.78T model, 64 GPUs
    python scripts/plan_parallel.py --search --optimizer adamw --lora-rank 16
    python scripts/plan_parallel.py --config small --world-size 2 --seq-len 16

Exact counts (parameters, gradients, optimizer state, buffers) come from kimi_k3.planning.plan; ``--verify`` checks
them against the project's real sharding of the model on the meta device under torch's fake process group.
Exit status: 0 when the plan is printed (fitting or not), 1 when verification finds a mismatch, 2 on bad input.
"""

import argparse
import sys
from pathlib import Path

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.planning.plan import (
    DTYPE_BYTES,
    GB,
    OPTIMIZERS,
    Layout,
    PlanError,
    Setup,
    make_plan,
    search,
)

OPTIMIZER_NAMES = {"muon": "Per-Head Muon", "adamw": "AdamW"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="k3", help="'k3' (released preset), 'small' (the default config) or a "
                                                       "config.json path / model folder")
    layout = parser.add_argument_group("layout")
    layout.add_argument("--world-size", type=int, help="number of ranks (GPUs)")
    layout.add_argument("--fsdp", type=int, help="FSDP2 size (default: world size / tp)")
    layout.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides fsdp and the experts)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size (only 1 is supported)")
    layout.add_argument("--search", action="store_true", help="find the smallest world size with a layout that fits")
    layout.add_argument("--max-world-size", type=int, default=4096)
    layout.add_argument("--gpus-per-node", type=int, default=8, help="search step")
    run = parser.add_argument_group("training")
    run.add_argument("--gpu-memory-gb", type=float, default=141.0)
    run.add_argument("--reserved-gb", type=float, default=4.0, help="per GPU: CUDA context, allocator slack")
    run.add_argument("--micro-batch", type=int, default=1)
    run.add_argument("--seq-len", type=int, default=4096)
    run.add_argument("--grad-accum", type=int, default=1)
    run.add_argument("--no-gradient-checkpointing", action="store_true")
    for name, default in (("param", "fp32"), ("compute", "bf16"), ("grad", "fp32"), ("optimizer", "fp32")):
        run.add_argument(f"--{name}-dtype", default=default, choices=tuple(DTYPE_BYTES))
    run.add_argument("--ns-dtype", default="bf16", choices=("bf16", "fp32"), help="Per-Head Muon's Newton–Schulz "
                                                                                 "precision (bf16 on GPUs)")
    run.add_argument("--optimizer", default="muon", choices=OPTIMIZERS)
    run.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    run.add_argument("--qat", action="store_true", help="MXFP4 quantization-aware training of the experts")
    run.add_argument("--no-qk-clip", action="store_true")
    check = parser.add_argument_group("verification")
    check.add_argument("--verify", action="store_true", help="check the counts against the real sharding (meta device)")
    check.add_argument("--sharding", choices=("accelerate", "transformers"),
                       help="sharding path to verify (default: transformers with ep > 1, else shard_decoder_layers)")
    args = parser.parse_args(argv)
    if args.search == (args.world_size is not None):
        parser.error("give exactly one of --world-size N and --search")
    return args


def load_config(name: str) -> KimiK3Config:
    if name == "k3":
        return KimiK3Config.kimi_k3()
    if name == "small":
        return KimiK3Config()
    path = Path(name)
    if not path.exists():
        raise PlanError(f"`--config` must be 'k3', 'small' or an existing config.json / model folder, got {name!r}.")
    try:
        return KimiK3Config.from_json_file(path / "config.json" if path.is_dir() else path)
    except (OSError, ValueError) as error:  # the config's own validation names the field
        raise PlanError(f"`--config` {name}: {str(error).splitlines()[0]}") from error


def setup_from(args) -> Setup:
    return Setup(micro_batch=args.micro_batch, sequence_length=args.seq_len, gradient_accumulation=args.grad_accum,
                 gradient_checkpointing=not args.no_gradient_checkpointing, param_dtype=args.param_dtype,
                 compute_dtype=args.compute_dtype, grad_dtype=args.grad_dtype, optimizer_dtype=args.optimizer_dtype,
                 ns_dtype=args.ns_dtype,
                 optimizer=args.optimizer, lora_rank=args.lora_rank, qat=args.qat, qk_clip=not args.no_qk_clip,
                 gpu_memory_gb=args.gpu_memory_gb, reserved_gb=args.reserved_gb)


def describe(plan) -> list[str]:
    config, layout, setup = plan.config, plan.layout, plan.setup
    total = plan.counts.parameters
    experts = ""
    if layout.ep > 1:
        experts = f", ep {layout.ep} ({config.num_experts // layout.ep} experts per ep rank, FSDP over {layout.efsdp})"
    training = "full fine-tuning" if not setup.lora_rank else f"LoRA r={setup.lora_rank} on attention projections"
    return [
        f"Kimi K3: {config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_experts} experts "
        f"(rank 0 holds {total:,} parameter elements)",
        f"layout: {layout.world_size} ranks = fsdp {layout.fsdp} x tp {layout.tp}{experts}",
        f"run: micro-batch {setup.micro_batch} x {setup.sequence_length} tokens, gradient accumulation "
        f"{setup.gradient_accumulation}, checkpointing {'on' if setup.gradient_checkpointing else 'off'}, "
        f"{OPTIMIZER_NAMES[setup.optimizer]}, {training}{', MXFP4 QAT' if setup.qat else ''}; dtypes: params "
        f"{setup.param_dtype}, compute {setup.compute_dtype}, grads {setup.grad_dtype}, optimizer {setup.optimizer_dtype}",
    ]


def memory_table(plan) -> list[str]:
    counts = plan.counts
    elements = {"parameters": counts.parameters, "gradients": counts.gradients, "Muon momentum": counts.muon_momentum,
                "AdamW moments": counts.adamw_exp_avg + counts.adamw_exp_avg_sq}
    lines = [f"{'memory per rank (rank 0)':<30} {'elements':>18} {'GB':>11}  kind", "-" * 70]
    for category, size in plan.memory.items():
        kind = "estimate" if category in plan.estimated else "exact"
        count = f"{elements[category]:,}" if category in elements else ""
        lines.append(f"{category:<30} {count:>18} {size / GB:>11,.2f}  {kind}")
    lines.append("-" * 70)
    lines.append(f"{'total':<30} {'':>18} {plan.total / GB:>11,.2f}  of {plan.budget / GB:,.1f} GB usable "
                 f"({plan.setup.gpu_memory_gb:g} GB - {plan.setup.reserved_gb:g} GB reserved)")
    other = "off" if plan.setup.gradient_checkpointing else "on"
    lines.append(f"activations with gradient checkpointing {other}: {plan.activations_other / GB:,.2f} GB")
    return lines


def communication_table(plan) -> list[str]:
    lines = [f"{'communication per step per rank':<42} {'group':>6} {'calls':>7} {'payload GB':>12} {'sent GB':>11}",
             "-" * 82]
    for name, group, calls, payload, sent in plan.communication:
        lines.append(f"{name:<42} {group:>6} {calls:>7} {payload / GB:>12,.3f} {sent / GB:>11,.3f}")
    if not plan.communication:
        lines.append("(none: one rank)")
    lines.append("payload: bytes this rank hands to the collectives; sent: bytes it sends on a ring (all-to-all: "
                 "balanced routes)")
    return lines


def verdict(plan) -> str:
    if plan.fits:
        return f"fits: {plan.total / GB:,.2f} GB of {plan.budget / GB:,.1f} GB usable per rank"
    category = plan.largest_category
    return (f"DOES NOT FIT: {plan.total / GB:,.2f} GB needed per rank, {plan.budget / GB:,.1f} GB usable; overflowing "
            f"category: {category} ({plan.memory[category] / GB:,.2f} GB, "
            f"{plan.memory[category] / plan.total:.0%} of the need)")


def verify(plan, sharding) -> bool:
    from kimi_k3.planning.verify import default_sharding_path, differences, sharded_run

    path = sharding or default_sharding_path(plan.layout)
    run = sharded_run(plan.config, plan.layout, plan.setup, path)
    mismatches = differences(plan, run)
    what = ("shard_decoder_layers (FSDP2 per decoder layer)" if path == "accelerate"
            else "transformers' load-time sharding (DistributedConfig, base_model_ep_plan)")
    if mismatches:
        print(f"MISMATCH against the meta model sharded by {what} on rank 0 of {plan.layout.world_size}:")
        for line in mismatches:
            print(f"  {line}")
        return False
    print(f"verified: parameters, gradients, optimizer state and buffers of rank 0 equal, element for element, what "
          f"{what} and {OPTIMIZER_NAMES[plan.setup.optimizer]} hold on the meta model under a fake process group of "
          f"{plan.layout.world_size} ranks; every parameter's placements, the optimizer step's collectives "
          f"({len(run.sent.calls)} calls, {run.sent.payload:,} bytes) and its Newton-Schulz block assignment match the "
          f"plan's")
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config)
        setup = setup_from(args)
        if args.search:
            plan, best = search(config, setup, args.max_world_size, args.gpus_per_node)
            if plan is None:
                print(f"no layout up to {args.max_world_size} ranks fits; the least-memory layout there:")
                plan = best
            else:
                print(f"smallest world size that fits: {plan.layout.world_size} (ep {plan.layout.ep})")
        else:
            fsdp = args.fsdp if args.fsdp is not None else args.world_size // max(args.tp, 1)
            plan = make_plan(config, Layout(args.world_size, fsdp, args.ep, args.tp), setup)
    except PlanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join([*describe(plan), "", *memory_table(plan), "", *communication_table(plan), "", *plan.notes]))
    print(verdict(plan))
    if args.verify and not verify(plan, args.sharding):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
