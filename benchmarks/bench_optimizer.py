"""P4: Per-Head Muon against AdamW and torch.optim.Muon: optimizer step time and loss at equal steps.

(a) ``run()`` (part of ``run_all.py``): step time on the default ``KimiK3Config()`` model with fixed random
    gradients, interleaved, as ratios to AdamW measured in the same run:
    - PerHeadMuon (per-head q/k/v blocks, experts per matrix, AdamW for the rest, as `build_param_groups` splits them);
    - the same optimizer with whole q/k/v matrices, which isolates the per-head Newton–Schulz cost;
    - torch.optim.Muon(adjust_lr_fn="match_rms_adamw") on the 2-D Muon matrices, AdamW on everything else
      (including the 3-D experts, which torch's Muon rejects);
    - AdamW, fused (the Trainer default);
    - PerHeadMuon with its Newton–Schulz in fp32 and in bf16 (``ns_dtype``), and Newton–Schulz alone on its blocks,
      in its batch-invariant chunks and in one call per block shape (what it did before; not batch-invariant);
    - the floor any exact NS5 has here in each dtype: its FLOPs at the matmul rate of the same block shapes in that
      dtype, measured in the run;
    - the step's elementwise passes over one parameter (momentum with the Nesterov update in bf16, then decay with
      the update; ``kimi_k3/optim/elementwise.py``), eager against compiled, by parameter size: where the compiled
      loops pay.
(b) ``transformers.Trainer`` with PerHeadMuon and with the Trainer's AdamW for the same steps on byte-level text of
    Python's own documentation (``pydoc_data.topics``), same init and data order, printing the final eval losses.
    The learning rates were tuned once with ``--sweep`` at the defaults (final eval loss; best in brackets):
    PerHeadMuon 1e-3: 2.021, [3e-3: 1.745], 1e-2: 1.770, 2e-2: 2.097; AdamW 1e-3: 2.012, [3e-3: 1.983], 1e-2: 2.239.
    Runs are bitwise reproducible for a fixed model code; its later changes moved these losses by ~0.03.

    python benchmarks/bench_optimizer.py            # both tables, a few minutes on two cores
    python benchmarks/bench_optimizer.py --sweep    # the learning-rate grid of (b)
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import report, time_interleaved  # noqa: E402
import torch  # noqa: E402
from pydoc_data.topics import topics  # noqa: E402
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.optim.muon import (  # noqa: E402
    NS_STEPS,
    PerHeadMuon,
    PerHeadMuonFactory,
    build_param_groups,
    orthogonalize_by_shape,
    row_pattern,
    split_row_blocks,
)
from kimi_k3.job.allocator import restart_under_tcmalloc  # noqa: E402
from kimi_k3.optim.elementwise import COMPILED, decay_and_add_, momentum_and_nesterov_update_  # noqa: E402
from kimi_k3.optim.newton_schulz import newton_schulz5_call  # noqa: E402
from kimi_k3.optim.precision import cpu_has_native_bf16  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402

TUNED_LR = {"PerHeadMuon": 3e-3, "AdamW": 3e-3}
LR_GRID = {"PerHeadMuon": (1e-3, 3e-3, 1e-2, 2e-2), "AdamW": (1e-3, 3e-3, 1e-2)}
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed steps per optimizer in (a)")
    parser.add_argument("--steps", type=int, default=200, help="Trainer optimizer steps per run in (b)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step in (b)")
    parser.add_argument("--seq-len", type=int, default=64, help="bytes per sequence in (b)")
    parser.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences for the eval loss")
    parser.add_argument("--sweep", action="store_true", help="run the learning-rate grid of (b) instead")
    parser.add_argument("--skip-timing", action="store_true", help="only run (b)")
    parser.add_argument("--skip-training", action="store_true", help="only run (a)")
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------ (a) step time


# bf16 candidates only where bf16 matmuls are native: emulated, one bf16 step of the default model takes minutes.
NS_DTYPES = {"fp32": torch.float32, **({"bf16": torch.bfloat16} if cpu_has_native_bf16() else {})}


def step_time_optimizers(model: KimiK3ForCausalLM) -> dict[str, list[torch.optim.Optimizer]]:
    groups = build_param_groups(model, weight_decay=WEIGHT_DECAY)
    whole = [{key: value for key, value in group.items() if key != "head_rows"} for group in groups]
    muon_matrices = [p for group in groups if group["use_muon"] for p in group["params"] if p.ndim == 2]
    matrix_ids = {id(p) for p in muon_matrices}
    others = [p for p in model.parameters() if id(p) not in matrix_ids]
    return {
        **{f"PerHeadMuon, NS in {name}": [PerHeadMuon(groups, betas=BETAS, ns_dtype=dtype)]
           for name, dtype in NS_DTYPES.items()},
        "PerHeadMuon, whole q/k/v (auto NS dtype)": [PerHeadMuon(whole, betas=BETAS)],
        "torch Muon (2-D) + AdamW": [
            torch.optim.Muon(muon_matrices, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(others, weight_decay=WEIGHT_DECAY, betas=BETAS, fused=True),
        ],
        "AdamW (fused)": [torch.optim.AdamW(model.parameters(), weight_decay=WEIGHT_DECAY, betas=BETAS, fused=True)],
    }


def newton_schulz_blocks(optimizer: PerHeadMuon) -> list[torch.Tensor]:
    """The block stacks ``optimizer`` orthogonalizes (the gradients stand in for the Nesterov momentum)."""
    groups = [group for group in optimizer.param_groups if group["use_muon"]]
    return [stack for group in groups for p in group["params"] for stack in split_row_blocks(p.grad, row_pattern(group))]


def newton_schulz_flops(stacks: list[torch.Tensor]) -> float:
    """NS5 FLOPs: per step X·Xᵀ (2r²c), A·A (2r³) and B·X (2r²c) on the wide view (r <= c) of every block."""
    total = 0.0
    for stack in stacks:
        rows, cols = sorted(stack.shape[1:])
        total += stack.shape[0] * NS_STEPS * (4 * rows * rows * cols + 2 * rows**3)
    return total


def one_call_per_shape(stacks: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Newton–Schulz with every block of one shape in a single call, as before it became batch-invariant: a block's
    result then depends on how many blocks share its call (kimi_k3/optim/newton_schulz.py)."""
    outputs = []
    for shape in {s.shape[1:] for s in stacks}:
        batch = torch.cat([s.to(dtype) for s in stacks if s.shape[1:] == shape])
        tall = batch.shape[-2] > batch.shape[-1]
        result = newton_schulz5_call(batch.mT if tall else batch)
        outputs.append(result.mT if tall else result)
    return outputs


def block_matmul_probe(stacks: list[torch.Tensor], dtype: torch.dtype) -> tuple[Callable, float]:
    """One X·Xᵀ over all blocks in ``dtype``, grouped by shape as NS5 runs it, and its FLOPs: the rate NS5 can reach."""
    batches = [torch.cat([s.to(dtype) for s in stacks if s.shape[1:] == shape]) for shape in {s.shape[1:] for s in stacks}]
    batches = [batch.mT if batch.shape[-2] > batch.shape[-1] else batch for batch in batches]
    flops = sum(2.0 * b.shape[0] * b.shape[-2] ** 2 * b.shape[-1] for b in batches)
    return (lambda: [b @ b.mT for b in batches]), flops


def elementwise_passes(size: int, compiled: bool) -> Callable:
    """The elementwise passes of a single-process Per-Head Muon step over one parameter of ``size`` elements."""
    buffer, grad, param = (torch.randn(size) for _ in range(3))
    call = (lambda function, *args: COMPILED[function](*args)) if compiled else (lambda function, *args: function(*args))

    def step():
        update = call(momentum_and_nesterov_update_, buffer, grad, 0.95, torch.bfloat16)
        call(decay_and_add_, param, update, 1.0, -1e-9)

    return step


def elementwise_table(repeats: int, sizes=(2**14, 2**16, 2**17, 2**18, 2**19, 2**21)) -> dict:
    rows = []
    for size in sizes:
        seconds = time_interleaved({"eager": elementwise_passes(size, False),
                                    "compiled": elementwise_passes(size, True)}, repeats=repeats)
        rows.append({"elements": size, "eager µs": seconds["eager"] * 1e6, "compiled µs": seconds["compiled"] * 1e6,
                     "eager ÷ compiled": seconds["eager"] / seconds["compiled"]})
    return {"caption": "Momentum with the Nesterov update (bf16), then decay with the update, over one parameter, "
                       "eager and compiled (the step compiles them from "
                       "kimi_k3.optim.elementwise.COMPILED_MIN_ELEMENTS).",
            "columns": ["elements", "eager µs", "compiled µs", "eager ÷ compiled"], "rows": rows}


def adamw_table(model: KimiK3ForCausalLM, repeats: int) -> dict:
    """Per-Head Muon's AdamW parameters (norms, biases, embeddings, head) stepped by each of torch's AdamW loops."""
    adamw_params = [p for group in build_param_groups(model) if not group["use_muon"] for p in group["params"]]
    candidates = {}
    for name, loop in {"single-tensor (torch's default for CPU tensors)": {"foreach": False},
                       "foreach": {"foreach": True}, "fused (Per-Head Muon's choice)": {"fused": True}}.items():
        copies = [p.detach().clone().requires_grad_() for p in adamw_params]
        for copy, p in zip(copies, adamw_params):
            copy.grad = p.grad.clone()
        optimizer = torch.optim.AdamW(copies, weight_decay=WEIGHT_DECAY, betas=BETAS, **loop)
        optimizer.step()  # allocates the state
        candidates[name] = optimizer.step
    seconds = time_interleaved(candidates, repeats=repeats)
    fused = seconds["fused (Per-Head Muon's choice)"]
    rows = [{"loop": name, "step ms": value * 1e3, "÷ fused": value / fused} for name, value in seconds.items()]
    return {"caption": f"The {len(adamw_params)} parameters ({sum(p.numel() for p in adamw_params):,} elements) "
                       "Per-Head Muon steps with AdamW, by torch's AdamW loop.",
            "columns": ["loop", "step ms", "÷ fused"], "rows": rows}


def run(quick: bool = False, repeats: int | None = None) -> dict:
    repeats = repeats or (2 if quick else 5)
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    candidates, optimizers_by_name = {}, step_time_optimizers(model)
    for name, optimizers in optimizers_by_name.items():
        for optimizer in optimizers:  # the first step allocates the state
            optimizer.step()
        candidates[name] = lambda optimizers=optimizers: [optimizer.step() for optimizer in optimizers]
    stacks = newton_schulz_blocks(optimizers_by_name["PerHeadMuon, NS in fp32"][0])
    probe_flops = {}
    for name, dtype in NS_DTYPES.items():
        candidates[f"Newton-Schulz alone, {name}"] = lambda dtype=dtype: orthogonalize_by_shape(stacks, dtype)
        candidates[f"Newton-Schulz alone, one call per shape (not batch-invariant), {name}"] = (
            lambda dtype=dtype: one_call_per_shape(stacks, dtype))
        candidates[f"probe: {name} X·Xᵀ of the same blocks"], probe_flops[name] = block_matmul_probe(stacks, dtype)
    seconds = time_interleaved(candidates, repeats=repeats)
    adamw = seconds["AdamW (fused)"]
    ns_flops = newton_schulz_flops(stacks)
    rates = {name: flops / seconds.pop(f"probe: {name} X·Xᵀ of the same blocks") for name, flops in probe_flops.items()}
    floors = {name: ns_flops / rate for name, rate in rates.items()}
    rows = []
    for name, value in seconds.items():
        dtype = next((d for d in NS_DTYPES if name.endswith(f" {d}")), None)
        rows.append({"optimizer": name, "step ms": value * 1e3, "÷ AdamW": value / adamw,
                     "÷ NS floor, same dtype": value / floors[dtype] if dtype else None})
    for name, floor in floors.items():
        rows.append({"optimizer": f"floor: NS5 FLOPs at the probed {name} rate", "step ms": floor * 1e3,
                     "÷ AdamW": floor / adamw, "÷ NS floor, same dtype": 1.0})
    auto = PerHeadMuon(build_param_groups(model)).ns_dtype
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    return {
        "title": f"P4 - optimizer step, default KimiK3Config() ({millions:.1f}M parameters), random gradients",
        "tables": [{"caption": "", "columns": ["optimizer", "step ms", "÷ AdamW", "÷ NS floor, same dtype"],
                    "rows": rows}, elementwise_table(repeats), adamw_table(model, repeats)],
        "notes": [
            f"Newton–Schulz: {sum(s.shape[0] for s in stacks):,} blocks, {ns_flops / 1e9:.0f} GFLOP per step; block "
            f"matmuls ran at {', '.join(f'{rate / 1e9:.0f} GFLOP/s in {name}' for name, rate in rates.items())} here "
            "(bf16 is left out where it is emulated). PerHeadMuon's default (ns_dtype='auto') picks "
            f"{str(auto).removeprefix('torch.')} on this machine.",
            "AdamW is memory-bound (a few passes over the parameters); Muon adds O(rows) FLOPs per parameter. The floor "
            "rows are what NS5's matmuls cost at the probed rates; only kernels PyTorch does not offer (batched "
            "symmetric products for X·Xᵀ and A·A, about a third fewer FLOPs) or a faster matmul could go below them.",
            "Targets: a PerHeadMuon step <= 1.5x the NS floor of its dtype; <= 1.5x AdamW (below the floor here).",
        ],
    }


# ------------------------------------------------------------------------------------------------ (b) Trainer runs


def byte_splits(seq_len: int, eval_sequences: int) -> tuple[list[dict], list[dict]]:
    """Non-overlapping byte chunks of the pydoc topics (a byte is its token id); the last chunks are held out."""
    text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    chunks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)
    rows = [{"input_ids": chunk, "labels": chunk} for chunk in chunks]
    return rows[:-eval_sequences], rows[-eval_sequences:]


def small_k3_config() -> KimiK3Config:
    """KDA, MLA, KDA, MLA with MoE (16 experts, top 2) at a width that trains 200 steps in about a minute."""
    return KimiK3Config(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_heads=4,
        linear_head_dim=32,
        intermediate_size=384,
        num_experts=16,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=64,
        routed_expert_hidden_size=64,
        attn_res_block_size=2,
    )


def final_eval_loss(optimizer_name: str, lr: float, args: argparse.Namespace, splits) -> float:
    train, held_out = splits
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(small_k3_config())
    training_args = TrainingArguments(
        output_dir="/tmp/bench_optimizer", max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=lr, weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], lr_scheduler_type="cosine", warmup_steps=10,
        save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no",
    )
    factory = {"optimizer_cls_and_kwargs": (PerHeadMuonFactory, {"lr": lr, "weight_decay": WEIGHT_DECAY,
                                                                 "adamw_betas": BETAS})}
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
                      **(factory if optimizer_name == "PerHeadMuon" else {}))
    for quiet in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(quiet)
    trainer.train()
    return trainer.evaluate()["eval_loss"]


def training_table(args: argparse.Namespace, learning_rates: dict[str, tuple[float, ...]]) -> str:
    splits = byte_splits(args.seq_len, args.eval_sequences)
    lines = [
        f"(b) Trainer, {args.steps} steps × {args.batch_size}×{args.seq_len} bytes of pydoc topics, cosine, "
        f"eval on {args.eval_sequences} held-out sequences",
        "",
        "| optimizer | lr | final eval loss | wall (s) |",
        "|---|---:|---:|---:|",
    ]
    for name, grid in learning_rates.items():
        for lr in grid:
            start = time.perf_counter()
            loss = final_eval_loss(name, lr, args, splits)
            lines.append(f"| {name} | {lr:g} | {loss:.4f} | {time.perf_counter() - start:.0f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main() -> None:
    restart_under_tcmalloc(Path(sys.argv[0]).name)  # as kimi-k3-train and the other benchmarks run
    args = parse_args()
    if not args.skip_timing and not args.sweep:
        report("optimizer", run(repeats=args.repeats))
    if not args.skip_training:
        grid = LR_GRID if args.sweep else {name: (lr,) for name, lr in TUNED_LR.items()}
        print(training_table(args, grid))


if __name__ == "__main__":
    main()
