"""Router load balance of a tiny K3 model trained with Quantile Balancing, the sign rule and no balancing.

Trains the same model (same init, same data order) three times with ``transformers.Trainer`` on byte-level text
of Python's own documentation (``pydoc_data.topics``) and prints a markdown table of MaxVio over the steps
(MaxVio: Loss-Free Balancing, arXiv:2408.15664, Eq. 4); writes a PNG when matplotlib is importable.

    python benchmarks/bench_balancing.py --steps 100
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from pydoc_data.topics import topics
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.job.expert_load import PLOT_EXTRA, matplotlib_available, new_figure, plot_max_vio  # noqa: E402
from kimi_k3.policies.quantile_balancing import QuantileBalancingCallback  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402

RULES = {
    "QB": {"update_rule": "quantile"},
    "sign γ=1e-3": {"update_rule": "sign", "sign_gamma": 1e-3},
    "none": {"update_rule": "none"},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    # Many short sequences per step: byte-level text from few documents is too correlated for a per-step balance.
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=32, help="bytes per sequence")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=5, help="decoder layers (the first is dense)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=10, help="table rows (evenly spaced steps)")
    parser.add_argument("--png", default="outputs/bench_balancing.png", help="plot path ('' to skip)")
    return parser.parse_args()


def byte_sequences(seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Non-overlapping byte-level chunks of the pydoc topics; a byte is its own token id."""
    text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    chunks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)
    return [{"input_ids": chunk, "labels": chunk} for chunk in chunks]


def tiny_k3_config(args: argparse.Namespace) -> KimiK3Config:
    """Default K3 sparsity and layer pattern at a width that trains on two CPU cores in about a minute."""
    return KimiK3Config(
        vocab_size=256,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        # MLA at every fourth layer, or at the last of fewer than four.
        layer_types=["full_attention" if i % 4 == 0 or args.layers < 4 and i == args.layers else "linear_attention"
                     for i in range(1, args.layers + 1)],
        linear_num_heads=2,
        linear_head_dim=16,
        intermediate_size=4 * args.hidden_size,
        moe_intermediate_size=32,
        routed_expert_hidden_size=args.hidden_size // 2,
        max_position_embeddings=args.seq_len,
    )


def train(config: KimiK3Config, data, rule: dict, args: argparse.Namespace) -> tuple[list[dict], float]:
    """One training run; returns the per-step log entries (loss and balance metrics) and the wall time."""
    torch.manual_seed(args.seed)
    model = KimiK3ForCausalLM(config)
    training_args = TrainingArguments(
        output_dir="/tmp/bench_balancing",
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=max(1, args.steps // 100),
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    QuantileBalancingCallback(model, per_layer_metrics=False, **rule).attach(trainer)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    return [entry for entry in trainer.state.log_history if "balance/max_vio" in entry], wall


def markdown_table(runs: dict[str, list[dict]], num_rows: int) -> str:
    """MaxVio of the worst layer (mean over layers in brackets) at evenly spaced steps, plus a summary."""
    names = list(runs)
    steps = len(next(iter(runs.values())))
    rows = sorted({1, steps} | {round(steps * i / (num_rows - 1)) or 1 for i in range(num_rows)})
    lines = ["| step | " + " | ".join(f"{name} MaxVio" for name in names) + " |", "|---" * (len(names) + 1) + "|"]
    for step in rows:
        entries = [run[step - 1] for run in runs.values()]
        cells = [f"{entry['balance/max_vio']:.2f} ({entry['balance/max_vio_mean']:.2f})" for entry in entries]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    tail = max(1, steps // 5)
    summary = {
        f"mean MaxVio, last {tail} steps": lambda run: f"{sum(e['balance/max_vio'] for e in run[-tail:]) / tail:.3f}",
        f"mean CV, last {tail} steps": lambda run: f"{sum(e['balance/cv_mean'] for e in run[-tail:]) / tail:.3f}",
        "dead experts (all layers), last step": lambda run: f"{run[-1]['balance/dead_experts']}",
        "loss, last step": lambda run: f"{run[-1]['loss']:.3f}",
    }
    for label, cell in summary.items():
        lines.append(f"| {label} | " + " | ".join(cell(run) for run in runs.values()) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: str) -> None:
    if not matplotlib_available():
        print(f"matplotlib is not importable: no plot ({PLOT_EXTRA})")
        return
    figure = new_figure(figsize=(7, 4))
    axis = figure.subplots()
    plot_max_vio(axis, {name: [(entry["step"], entry["balance/max_vio"]) for entry in run] for name, run in runs.items()})
    axis.set(ylabel="MaxVio (worst MoE layer)", title="Tiny K3 router balance")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    args = parse_args()
    config = tiny_k3_config(args)
    data = byte_sequences(args.seq_len)
    tokens_per_step = args.batch_size * args.seq_len
    print(
        f"{config.num_experts} experts, top-{config.num_experts_per_token}, {config.num_hidden_layers} layers "
        f"(hidden {config.hidden_size}); {tokens_per_step} tokens/step, ideal load "
        f"{tokens_per_step * config.num_experts_per_token / config.num_experts:.0f}; {args.steps} steps per run"
    )
    runs = {}
    for name, rule in RULES.items():
        runs[name], wall = train(config, data, rule, args)
        print(f"{name}: {wall:.0f} s")
    print()
    print(markdown_table(runs, args.rows))
    if args.png:
        plot(runs, args.png)


if __name__ == "__main__":
    main()
