"""MXFP4 quantization-aware training vs post-training quantization of the routed experts (kimi_k3.quantization.qat).

Starting from a trained model (the default `kimi-k3-train` run's `model/` folder), fine-tune it on the embedded corpus
for the same number of steps twice with `kimi-k3-train`: (a) plain, then export to the released layout (post-training
quantization, PTQ), and (b) with `--qat mxfp4`, then export. Each variant's held-out loss is measured before export
(the fine-tuned model as trained: fp32 experts for PTQ, fake-quantized experts for QAT) and after export (the
released folder loaded back), on the same validation blocks. A second table times one training step (forward,
backward, Per-Head Muon) of the start model with and without QAT, interleaved in one process.

    python benchmarks/bench_qat.py --base outputs/kimi-k3-small/model --steps 30
    python benchmarks/bench_qat.py --base outputs/kimi-k3-small/model --steps 30 --learning_rate 1e-2
    python benchmarks/bench_qat.py --quick       # a toy model trained from scratch in a few steps (smoke run)
"""

import contextlib
import io
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from benchmarks.common import bench_arguments, report, time_interleaved  # noqa: E402
from configuration_kimi_k3 import TINY  # noqa: E402
from kimi_k3.job import main as train  # noqa: E402
from kimi_k3.job.final_save import FINAL_MODEL_DIR  # noqa: E402
from kimi_k3.text.corpus import load_corpus, tokenize_into_blocks  # noqa: E402
from kimi_k3.optim.muon import PerHeadMuon  # noqa: E402
from kimi_k3.quantization.qat import (  # noqa: E402
    attach_qat,
    fake_quantize_mxfp4,
    fake_quantize_mxfp4_eager,
    fake_quantize_mxfp4_reference,
    find_routed_experts,
)
from kimi_k3.checkpoint.release_format import export_released  # noqa: E402
from kimi_k3.text.tokenizer import load_tokenizer  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402

# `KimiK3Config.tiny()` with expert widths MXFP4 can store (multiples of its 32-element groups), its vocabulary sized
# by the tokenizer.
QUICK_MODEL = {key: value for key, value in TINY.items() if key != "vocab_size"} | {
    "routed_expert_hidden_size": 32, "moe_intermediate_size": 32,
}


def arguments(parser) -> None:
    parser.add_argument("--base", type=Path, default=None, help="trained model folder to fine-tune")
    parser.add_argument("--steps", type=int, default=30, help="fine-tuning steps of each variant")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="fine-tuning learning rate")
    parser.add_argument("--batch_size", type=int, default=8, help="training sequences per step")
    parser.add_argument("--qat_activations", default="none", help="also fake-quantize expert inputs (mxfp8)")
    parser.add_argument("--skip-timing", action="store_true", help="only the quality table")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here instead of a temp dir")


def run_training(argv: list[str]) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = train.main(argv)
    if status != 0:
        raise SystemExit(f"kimi-k3-train {' '.join(argv)} failed with status {status}:\n{printed.getvalue()[-2000:]}")


def quick_base(folder: Path) -> Path:
    """A toy model trained for a few steps: stands in for the default run in --quick mode."""
    run_training(["--output_dir", str(folder), "--config_overrides", json.dumps(QUICK_MODEL), "--max_steps", "8",
                  "--tokenizer_vocab_size", "512", "--eval_strategy", "no", "--save_strategy", "no",
                  "--disable_tqdm", "True", "--logging_steps", "100"])  # fmt: skip
    return folder / FINAL_MODEL_DIR


def fine_tune(base: Path, folder: Path, args, qat: bool) -> Path:
    extra = ["--qat", "mxfp4", "--qat_activations", args.qat_activations] if qat else []
    run_training([
        "--model_name_or_path", str(base), "--output_dir", str(folder), "--max_steps", str(args.steps),
        "--learning_rate", str(args.learning_rate), "--per_device_train_batch_size", str(args.batch_size),
        "--warmup_steps", str(max(1, args.steps // 10)), "--eval_strategy", "no", "--save_strategy", "no",
        "--disable_tqdm", "True", "--logging_steps", "100", *extra,
    ])  # fmt: skip
    return folder / FINAL_MODEL_DIR


@torch.no_grad()
def eval_loss(model: KimiK3ForCausalLM, blocks, batch_size: int = 16) -> float:
    """Mean next-token loss over the validation blocks (every block has the same length)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        input_ids = torch.tensor(blocks[start : start + batch_size]["input_ids"])
        total += model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item() * len(input_ids)
        count += len(input_ids)
    return total / count


def export_and_load(folder: Path) -> KimiK3ForCausalLM:
    released = folder.with_name(folder.name + "-released")
    export_released(folder, released, progress=False)
    return KimiK3ForCausalLM.from_pretrained(released)


def quality_rows(base: Path, scratch: Path, args, blocks) -> list[dict]:
    rows = []
    start_model = KimiK3ForCausalLM.from_pretrained(base)
    rows.append({"model": "start (not fine-tuned)", "eval loss before export": eval_loss(start_model, blocks),
                 "eval loss after export": eval_loss(export_and_load(_saved(start_model, scratch / "start")), blocks)})
    for variant, qat in (("PTQ: fine-tune, then export", False), ("QAT: fine-tune with --qat mxfp4, export", True)):
        folder = fine_tune(base, scratch / ("qat" if qat else "ptq"), args, qat)
        trained = KimiK3ForCausalLM.from_pretrained(folder)  # master weights
        row = {"model": variant, "eval loss, fp32 experts": eval_loss(trained, blocks)}
        if qat:
            attach_qat(trained)
        row["eval loss before export"] = eval_loss(trained, blocks)
        row["eval loss after export"] = eval_loss(export_and_load(folder), blocks)
        rows.append(row)
    for row in rows:
        row["export gap"] = f"{row['eval loss after export'] - row['eval loss before export']:+.5f}"
        row["perplexity after export"] = math.exp(row["eval loss after export"])
        for column in ("eval loss, fp32 experts", "eval loss before export", "eval loss after export"):
            if column in row:
                row[column] = f"{row[column]:.5f}"
    return rows


def _saved(model: KimiK3ForCausalLM, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def step_time_rows(base: Path, blocks, args) -> list[dict]:
    """One training step of the start model, plain and with QAT (weights, and weights + MXFP8 inputs)."""
    input_ids = torch.tensor(blocks[: args.batch_size]["input_ids"])
    variants = {}
    for name, activations in (("plain", None), ("QAT mxfp4", "none"), ("QAT mxfp4 + mxfp8 inputs", "mxfp8")):
        model = KimiK3ForCausalLM.from_pretrained(base).train()
        if activations is not None:
            attach_qat(model, activations=activations)
        optimizer = PerHeadMuon.for_model(model, lr=1e-5)
        variants[name] = _training_step(model, optimizer, input_ids)
    times = time_interleaved(variants, repeats=2 if args.quick else 4, slot_seconds=0)
    return [{"step": name, "seconds": seconds, "vs plain": seconds / times["plain"]} for name, seconds in times.items()]


def quantizer_rows(base: Path, args) -> list[dict]:
    """Fake-quantizing one layer's fused gate/up expert weight: the exporter's round trip, eager and compiled."""
    experts = next(iter(find_routed_experts(KimiK3ForCausalLM.from_pretrained(base)).values()))
    weight = experts.gate_up_proj.detach()
    candidates = {
        "pack + unpack (exporter, reference)": lambda: fake_quantize_mxfp4_reference(weight),
        "eager, on values": lambda: fake_quantize_mxfp4_eager(weight),
        "QAT's (compiled from 2^18 elements)": lambda: fake_quantize_mxfp4(weight),
    }
    times = time_interleaved(candidates, repeats=2 if args.quick else 5)
    reference = times["pack + unpack (exporter, reference)"]
    shape = "x".join(map(str, weight.shape))
    return [{"fake-quantizer": name, "weight": shape, "ms": seconds * 1e3, "speed-up vs reference": reference / seconds}
            for name, seconds in times.items()]  # fmt: skip


def _training_step(model, optimizer, input_ids):
    def step() -> None:
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    args = bench_arguments(__doc__.splitlines()[0], arguments)
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.keep or Path(temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        if args.quick:
            args.steps = min(args.steps, 4)
        base = quick_base(scratch / "quick-base") if args.quick or args.base is None else args.base
        splits, _ = load_corpus(None, "text", 5.0)
        blocks = tokenize_into_blocks(splits, load_tokenizer(base), 128)["validation"]
        quality = quality_rows(base, scratch, args, blocks)
        timing = [] if args.skip_timing else step_time_rows(base, blocks, args)
        quantizers = [] if args.skip_timing else quantizer_rows(base, args)
    tables = [
        {
            "caption": f"Fine-tuned {args.steps} steps from {base} (lr {args.learning_rate}, batch "
            f"{args.batch_size} x 128 tokens), then exported to the released layout; "
            f"{len(blocks)} held-out blocks of 128 tokens",
            "rows": quality,
            "columns": ["model", "eval loss, fp32 experts", "eval loss before export",
                        "eval loss after export", "export gap", "perplexity after export"],
        },  # fmt: skip
        {
            "caption": f"One training step (forward, backward, Per-Head Muon) of the start model, batch "
            f"{args.batch_size} x 128, interleaved",
            "rows": timing,
            "columns": ["step", "seconds", "vs plain"],
        },
        {
            "caption": "The MXFP4 fake-quantizer alone (bitwise equal outputs), interleaved",
            "rows": quantizers,
            "columns": ["fake-quantizer", "weight", "ms", "speed-up vs reference"],
        },
    ]
    report(
        "bench_qat",
        {
            "title": "MXFP4 QAT vs post-training quantization of the routed experts",
            "tables": [table for table in tables if table["rows"]],
            "notes": [
                "before export: the model as fine-tuned (PTQ: fp32 experts; QAT: experts fake-quantized to MXFP4, "
                "the forward it trained with); after export: the released folder loaded back",
                "the QAT export gap is zero by construction (fake-quantization equals the exporter bit for bit)",
            ],
        },
        args.json,
    )


if __name__ == "__main__":
    main()
