"""The end of a run: the final model folder with its card and expert-load picture, written atomically, and what the
card and the console report about the run."""

import contextlib
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import datasets
import torch
from transformers import Trainer

from kimi_k3.attachments.padding import masked_counts
from kimi_k3.attachments.seams import find_routers
from kimi_k3.checkpoint import run_folder
from kimi_k3.checkpoint.release_format import export_released
from kimi_k3.job import expert_load
from kimi_k3.job.arguments import ModelArguments, parse_qk_clip_tau
from kimi_k3.job.expert_load import ExpertLoadRecorder
from kimi_k3.job.launch import describe_autocast, describe_parallelism
from kimi_k3.job.resumable import TrainingClock
from kimi_k3.job.trainer import SaveError, batch_size, save_failure
from kimi_k3.policies.balance_metrics import load_balance_metrics
from kimi_k3.publishing.model_card import TrainingSummary
from kimi_k3.quantization.qat import weights_on_mxfp4_grid

FINAL_MODEL_DIR = "model"
# Inside the final folder: the checkpoint it was made from (hidden, so never published).
MADE_FROM_NAME = ".kimi-k3-made-from.json"


@torch.no_grad()
def measure_expert_load(model, blocks: datasets.Dataset, batch_size: int) -> dict[str, dict[str, float]]:
    """Per-layer load-balance metrics of the final routing (bias included) over held-out blocks.

    Routers record statistics only in training forwards, so the routes are read off their outputs with hooks.
    """
    routers = find_routers(model)
    loads = {name: torch.zeros(router.num_experts, dtype=torch.long) for name, router in routers.items()}

    def count_routes(name):
        def hook(router, inputs, outputs):  # masked_counts drops the unused slots (index n) of dynamic k
            loads[name] += masked_counts(outputs[2].cpu(), None, router.num_experts)

        return hook

    handles = [router.register_forward_hook(count_routes(name)) for name, router in routers.items()]
    model.eval()
    try:
        inputs = [name for name in ("input_ids", "position_ids") if name in blocks.column_names]
        for start in range(0, len(blocks), batch_size):
            batch = blocks[start : start + batch_size]
            model(**{name: torch.tensor(batch[name], device=model.device) for name in inputs}, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {name: load_balance_metrics(loads[name], router.e_score_correction_bias) for name, router in routers.items()}


def training_summary(trainer, model_args, data_description, blocks, block_size, eval_metrics, packing):
    """What the card reports; wall time and resumes come from the `TrainingClock`, which spans every job of the run."""
    clock = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TrainingClock))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    args = trainer.args
    global_batch_size = batch_size(args)["global"]
    # A stream's size is unknown: count the tokens trained on.
    train_blocks = len(blocks["train"]) if isinstance(blocks["train"], datasets.Dataset) else (
        trainer.state.global_step * global_batch_size
    )
    return TrainingSummary(
        data=data_description,
        train_tokens=train_blocks * block_size,
        eval_tokens=len(blocks["validation"]) * block_size,
        block_size=block_size,
        steps=trainer.state.global_step,
        global_batch_size=global_batch_size,
        optimizer=describe_optimizer(model_args, args),
        learning_rate=args.learning_rate,
        router_balancing=describe_router_balancing(model_args),
        first_loss=losses[0] if losses else math.nan,
        last_loss=losses[-1] if losses else math.nan,
        eval_loss=eval_metrics["eval_loss"],
        eval_perplexity=eval_metrics["eval_perplexity"],
        wall_time_s=clock.seconds(),
        base_model=model_args.model_name_or_path,
        resumed_at=clock.resumed_at,
        qat=describe_qat(model_args),
        weights_on_disk=describe_weights_on_disk(model_args, trainer.model),
        qk_clip=describe_qk_clip(model_args),
        packing=packing,
        parallelism=describe_parallelism(trainer),
        autocast=describe_autocast(trainer),
    )


def describe_optimizer(model_args: ModelArguments, args) -> str:
    if model_args.optimizer == "per_head_muon":
        return "Per-Head Muon + AdamW"
    if model_args.optimizer == "whole_matrix_muon":
        return "Muon (whole attention matrices) + AdamW"
    return f"Trainer's `{args.optim.value}` (--optim)"


def describe_router_balancing(model_args: ModelArguments) -> str:
    rule = {"quantile": "quantile_balancing", "sign": f"sign update (gamma = {model_args.sign_balancing_gamma:g})",
            "none": "none"}[model_args.router_balancing]
    return rule + (f" + sequence-wise auxiliary loss (alpha = {model_args.aux_loss_alpha:g})"
                   if model_args.aux_loss_alpha else "")


def describe_qat(model_args: ModelArguments) -> str:
    if model_args.qat is None:
        return "none"
    activations = "full precision" if model_args.qat_activations == "none" else model_args.qat_activations.upper()
    return f"{model_args.qat.upper()} routed experts (activations: {activations})"


def describe_weights_on_disk(model_args: ModelArguments, model) -> str:
    if model_args.final_layout == "released":
        return "released layout, MXFP4 routed experts"
    layout = f"this project's layout, {str(model.dtype).removeprefix('torch.')}"
    if model_args.qat is not None:
        layout += " with the routed experts on the MXFP4 grid (the checkpoints keep the masters)"
    return layout


def weights_as_evaluated(model_args: ModelArguments, model) -> contextlib.AbstractContextManager:
    """What the final folder must hold for a plain reload to be the model the run evaluated: under QAT the routed
    experts' MXFP4 values (`weights_on_mxfp4_grid`), so that no loader needs to know about quantization."""
    return weights_on_mxfp4_grid(model) if model_args.qat is not None else contextlib.nullcontext()


def describe_qk_clip(model_args: ModelArguments) -> str:
    tau = parse_qk_clip_tau(model_args.qk_clip_tau)
    return "off" if tau is None else f"tau = {tau:g}"


def local_folder_name(model_dir: Path) -> str:
    """How the card's usage snippet names the saved folder: relative to the working directory the job ran in, or,
    for a folder outside it, a placeholder the card explains (an absolute path would publish the disk's layout)."""
    relative = Path(os.path.relpath(model_dir.resolve(), Path.cwd().resolve()))
    return "path/to/model" if relative.parts[:1] == ("..",) else relative.as_posix()


def save_final_model(model, tokenizer, card, target: Path, tag: str | None = None, layout: str = "ours",
                     files: dict[str, bytes] | None = None, made_from: Path | None = None) -> Path:
    """Model, code, tokenizer, card and ``files`` (name -> content, e.g. the card's picture) written to a unique
    sibling staging folder, then swapped in (see `run_folder.replace_folder`); a failure raises `SaveError` and leaves
    any previous ``target`` whole. ``made_from``, the checkpoint of the saved weights, is recorded in the folder
    (`made_from_record`), so that running the finished job again knows the folder is its result.

    ``layout="released"`` converts the staged folder to the released layout (MXFP4 experts) before the swap; the
    folder holds whatever the model's parameters are (for a QAT run, save inside `weights_as_evaluated`).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = tag or run_folder.new_tag()
    staging = target.with_name(run_folder.staging_name(target.name, tag))
    released = target.with_name(run_folder.staging_name(f"{target.name}-released", tag))
    if model.config.mla_layer_indices:  # Trainer turns the cache off for training; the saved model decodes with it
        model.generation_config.use_cache = True
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if card is not None:
            card.save(staging / "README.md")
        for name, content in (files or {}).items():
            run_folder.write_new_file(staging / name, content)
        if layout == "released":
            export_released(staging, released, progress=False)
        finished = released if layout == "released" else staging
        if made_from is not None:
            run_folder.write_new_file(finished / MADE_FROM_NAME, json.dumps(made_from_record(made_from)).encode())
        run_folder.replace_folder(finished, target)
    except Exception as error:
        raise SaveError(save_failure(target.name, target.parent, error)) from error
    finally:
        for folder in (staging, released):
            shutil.rmtree(folder, ignore_errors=True)
    return target


def made_from_record(checkpoint: Path) -> dict[str, str]:
    """A checkpoint's identity: its folder name and a hash of its Trainer state (steps, logs, callbacks' records)."""
    state = hashlib.sha256((checkpoint / "trainer_state.json").read_bytes()).hexdigest()
    return {"checkpoint": checkpoint.name, "trainer_state_sha256": state}


def holds_final_model(checkpoint: Path, model_dir: Path) -> bool:
    """``model_dir`` is what the final save made of ``checkpoint``: it records that checkpoint (the folder is
    swapped in whole, so a folder with the record is complete, in whichever layout and precision it was saved)."""
    try:
        recorded = json.loads((model_dir / MADE_FROM_NAME).read_text())
    except (OSError, ValueError):
        return False
    return recorded == made_from_record(checkpoint)


def print_report(summary: TrainingSummary, model_dir: Path) -> None:
    print(
        f"first training loss {summary.first_loss:.4f} -> last {summary.last_loss:.4f}; "
        f"final eval loss {summary.eval_loss:.4f}, eval perplexity {summary.eval_perplexity:.2f}; "
        f"{summary.steps} steps in {summary.wall_time_s:.0f} s; model saved to {model_dir}"
    )


def expert_load_picture(trainer: Trainer, title: str) -> bytes | None:
    """The card's expert-load picture (`kimi_k3.job.expert_load`); None for a model without routed experts, or, after one
    line saying how to install it, without matplotlib."""
    recorder = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ExpertLoadRecorder)), None)
    if recorder is None:
        return None
    if not expert_load.matplotlib_available():
        print(f"kimi-k3-train: matplotlib is not installed, so no expert-load picture is drawn: {expert_load.PLOT_EXTRA}")
        return None
    return expert_load.expert_load_png(recorder.snapshots(), trainer.state.log_history, f"{title}: expert load")


def write_file_atomically(path: Path, content: bytes, tag: str) -> None:
    staged = path.with_name(run_folder.staging_name(path.name, tag))
    run_folder.write_new_file(staged, content)
    os.replace(staged, path)
