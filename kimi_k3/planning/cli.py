"""Per-rank memory and per-step communication of a Kimi K3 training layout, and whether it fits.

    kimi-k3-plan --world_size 64 --ep 8 --verify     # the released 2.78T model, 64 GPUs
    kimi-k3-plan --search --optimizer adamw --lora_rank 16
    kimi-k3-plan --config small --world_size 2 --block_size 16

Exact counts (parameters, gradients, optimizer state, buffers) come from kimi_k3.planning.plan; ``--verify`` checks
them against the project's real sharding of the model on the meta device under torch's fake process group.
Exit status: 0 when the plan is printed (fitting or not), 1 when verification finds a mismatch, 2 on bad input.
"""

import argparse
import sys
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers.hf_argparser import string_to_bool

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.job.arguments import DEFAULT_QK_CLIP_TAU, parse_qk_clip_tau
from kimi_k3.planning.plan import (
    DTYPE_BYTES,
    GB,
    Layout,
    PlanError,
    Setup,
    make_plan,
    search,
)

OPTIMIZER_NAMES = {"muon": "Per-Head Muon", "adamw": "AdamW"}


PROG = "kimi-k3-plan"
# The training job's names (`kimi-k3-train`) for the planner's choices.
OPTIMIZER_SPELLINGS = {"per_head_muon": "muon", "adamw": "adamw"}
NS_DTYPE_SPELLINGS = {"bfloat16": "bf16", "float32": "fp32"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="k3", help="'k3' (released preset), 'small' (the default config) or a "
                                                       "config.json path / model folder")
    layout = parser.add_argument_group("layout")
    layout.add_argument("--world_size", type=int, help="number of ranks (GPUs)")
    layout.add_argument("--fsdp", type=int, help="FSDP2 size (default: world size / tp)")
    layout.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides fsdp and the experts)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size (only 1 is supported)")
    layout.add_argument("--search", action="store_true", help="find the smallest world size with a layout that fits")
    layout.add_argument("--max_world_size", type=int, default=4096)
    layout.add_argument("--gpus_per_node", type=int, default=8, help="search step")
    run = parser.add_argument_group("training (the options of kimi-k3-train where it has them)")
    run.add_argument("--gpu_memory_gb", type=float, default=141.0)
    run.add_argument("--reserved_gb", type=float, default=4.0, help="per GPU: CUDA context, allocator slack")
    run.add_argument("--per_device_train_batch_size", type=int, default=1, help="micro-batch in sequences")
    run.add_argument("--block_size", type=int, default=4096, help="tokens per sequence")
    run.add_argument("--gradient_accumulation_steps", type=int, default=1)
    run.add_argument("--gradient_checkpointing", type=string_to_bool, default=True, help="true (default) or false")
    for name, default in (("param", "fp32"), ("compute", "bf16"), ("grad", "fp32"), ("optimizer", "fp32")):
        run.add_argument(f"--{name}_dtype", default=default, choices=tuple(DTYPE_BYTES))
    run.add_argument("--muon_ns_dtype", default="bfloat16", type=_spelled(NS_DTYPE_SPELLINGS, "--muon_ns_dtype"),
                     help="Per-Head Muon's Newton–Schulz precision: bfloat16 (the default: GPUs multiply it "
                          "natively) or float32")
    run.add_argument("--optimizer", default="per_head_muon", type=_spelled(OPTIMIZER_SPELLINGS, "--optimizer"),
                     help="per_head_muon (default) or adamw")
    run.add_argument("--lora_rank", type=int, default=0, help="0: full fine-tuning")
    run.add_argument("--qat", choices=("mxfp4",),
                     help="mxfp4: quantization-aware training of the experts")
    run.add_argument("--qk_clip_tau", default=DEFAULT_QK_CLIP_TAU,
                     help="QK-Clip's threshold; 0 or none: off (as kimi-k3-train)")
    check = parser.add_argument_group("verification")
    check.add_argument("--verify", action="store_true", help="check the counts against the real sharding (meta device)")
    check.add_argument("--sharding", choices=("accelerate", "transformers"),
                       help="sharding path to verify (default: transformers with ep > 1, else shard_decoder_layers)")
    args = parser.parse_args(argv)
    if args.search == (args.world_size is not None):
        parser.error("give exactly one of --world_size N and --search")
    try:
        args.qk_clip = parse_qk_clip_tau(args.qk_clip_tau) is not None
    except ValueError as error:
        parser.error(str(error))
    return args


def _spelled(spellings: dict[str, str], option: str):
    """An argparse type that accepts every spelling in ``spellings`` and gives the planner's name."""
    def parse(value: str) -> str:
        if value not in spellings:
            raise argparse.ArgumentTypeError(f"{option} must be one of {', '.join(spellings)}, got {value!r}")
        return spellings[value]

    return parse


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
    except (OSError, ValueError) as error:
        raise PlanError(f"`--config` {name}: {str(error).splitlines()[0]}") from error
    except StrictDataclassError as error:  # the config's own checks: the error's cause is one line naming the field
        raise PlanError(f"`--config` {name}: {error.__cause__ or error}") from error


def setup_from(args) -> Setup:
    return Setup(micro_batch=args.per_device_train_batch_size, sequence_length=args.block_size,
                 gradient_accumulation=args.gradient_accumulation_steps,
                 gradient_checkpointing=args.gradient_checkpointing, param_dtype=args.param_dtype,
                 compute_dtype=args.compute_dtype, grad_dtype=args.grad_dtype, optimizer_dtype=args.optimizer_dtype,
                 ns_dtype=args.muon_ns_dtype, optimizer=args.optimizer, lora_rank=args.lora_rank,
                 qat=args.qat is not None, qk_clip=args.qk_clip, gpu_memory_gb=args.gpu_memory_gb,
                 reserved_gb=args.reserved_gb)


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
