"""The training job's command line: its options (besides every ``TrainingArguments`` one), their defaults, and the
checks that stop a run with one line naming the flag before anything is written."""

import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import HfArgumentParser, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from configuration_kimi_k3 import KimiK3Config
from loading_kimi_k3 import MAX_JSON_FILE_BYTES, check_local_folder, checked_regular_file, folder_root
from kimi_k3.optim.precision import PRECISION_CHOICES, accelerator_has_native_bf16
from kimi_k3.policies.expert_merging import check_merging_arguments
from kimi_k3.policies.qk_clip import check_tau
from kimi_k3.publishing import hub
from kimi_k3.publishing.model_card import card_metadata, hub_repo_id, is_repo_id
from kimi_k3.quantization.qat import ACTIVATION_FORMATS, WEIGHT_FORMATS
from kimi_k3.text.corpus import PACKING_MODES, STREAM_EVAL_BLOCKS, STREAM_TOKENIZER_DOCUMENTS, DataError

OPTIMIZERS = ("per_head_muon", "whole_matrix_muon", "adamw")

# How the router bias moves between steps (`QuantileBalancing`'s update rules).
ROUTER_BALANCING = ("quantile", "sign", "none")

FINAL_LAYOUTS = ("ours", "released")

# K2's published QK-Clip threshold, which K3 keeps.
DEFAULT_QK_CLIP_TAU = "100"

# TrainingArguments defaults of this script (any of them can still be given on the command line): about 150 steps
# of 8 x 128 tokens, a few minutes on 2 CPU cores.
TRAINING_DEFAULTS = {
    "output_dir": "outputs/kimi-k3-small",
    "max_steps": 150,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "learning_rate": 3e-3,
    "weight_decay": 0.1,
    "adam_beta2": 0.95,
    "warmup_steps": 10,
    "lr_scheduler_type": "cosine",
    "logging_steps": 10,
    "logging_first_step": True,
    "eval_strategy": "steps",
    "eval_steps": 50,
    "save_strategy": "steps",
    "save_steps": 50,
    "save_total_limit": 2,
    "seed": 0,
    "report_to": "none",
    # bf16 autocast on an accelerator that multiplies bf16 natively (CUDA from Ampere on); CPUs train in fp32 unless
    # given --bf16 True (docs/training-performance.md, "Precision").
    "bf16": accelerator_has_native_bf16(),
    # Pinned host memory only speeds up copies to an accelerator; without one torch warns at every data loader.
    "dataloader_pin_memory": torch.accelerator.is_available(),
    # On CPUs, several threads make some reductions run in a different order each time, so identical runs (and a
    # resumed run against an uninterrupted one) drift apart; torch's deterministic kernels cost about 1-7% here.
    "full_determinism": not torch.accelerator.is_available(),
    # The only buffers are the router biases, equal on every rank: DDP's per-forward broadcast would only cost time.
    "ddp_broadcast_buffers": False,
    # Layer 0's self-attention AttnRes projection and norm never enter the graph (no block snapshot to weigh yet).
    # Trainer would switch the search off under activation checkpointing, and DDP then fails on them.
    "ddp_find_unused_parameters": True,
}


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Fine-tune this saved Kimi K3 folder instead of training a new model."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Use this tokenizer folder instead of the model folder's or a newly trained one."},
    )
    tokenizer_vocab_size: int = field(
        default=4096, metadata={"help": "Vocabulary size of the byte-level BPE trained on the training split."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": 'JSON object of KimiK3Config fields for a new model, e.g. \'{"hidden_size": 128}\'.'},
    )
    optimizer: str | None = field(
        default=None,
        metadata={"help": "per_head_muon (Muon for matrices, AdamW for the rest; the default), whole_matrix_muon "
                          "(the same with each attention Q, K, V projection orthogonalised whole, not per head) or "
                          "adamw (Trainer's own optimizer, chosen by --optim: AdamW unless --optim names another; "
                          "--optim alone implies it).", "choices": OPTIMIZERS},
    )
    muon_ns_dtype: str = field(
        default="auto",
        metadata={"help": "Newton–Schulz precision of Per-Head Muon: auto (bf16 where the device multiplies bf16 "
                          "natively, else fp32), bfloat16 or float32.", "choices": PRECISION_CHOICES},
    )
    quantile_balancing: bool = field(
        default=True,
        metadata={"help": "Update the router bias with Quantile Balancing; --no_quantile_balancing only logs loads."},
    )
    router_balancing: str | None = field(
        default=None,
        metadata={"help": "How the router bias moves after each step: quantile (Quantile Balancing, the default), "
                          "sign (DeepSeek-V3's b += γ·sign(mean load − load), γ = --sign_balancing_gamma) or none "
                          "(loads are still logged); --no_quantile_balancing is none.",
                  "choices": ROUTER_BALANCING},
    )
    sign_balancing_gamma: float = field(
        default=1e-3, metadata={"help": "With --router_balancing sign: its step γ (DeepSeek-V3's 1e-3)."}
    )
    aux_loss_alpha: float = field(
        default=0.0,
        metadata={"help": "Add DeepSeek-V3's sequence-wise auxiliary balance loss α·Σ f_i P_i to the training loss "
                          "(DeepSeek-V3: α = 1e-4, beside its sign rule); 0 (the default) adds none."},
    )
    fused_situ: bool = field(
        default=True,
        metadata={"help": "Compile SiTU-GLU and its backward into one kernel each (torch.compile, once per process) "
                          "for activations large enough to pay on this CPU; --no_fused_situ trains with the model's "
                          "eager reference."},
    )
    fused_attention_residuals: bool = field(
        default=True,
        metadata={"help": "Compile the Block AttnRes mixes with their backward (torch.compile, once per process); "
                          "--no_fused_attention_residuals trains with the model's eager reference."},
    )
    sorted_experts: bool = field(
        default=True,
        metadata={"help": "Gather the routed experts' tokens with index_select/index_add, whose backward needs no "
                          "sort under deterministic algorithms; --no_sorted_experts trains with the model's experts "
                          "implementation."},
    )
    flush_subnormals: bool = field(
        default=False,
        metadata={"help": "Flush subnormal floats to zero on every CPU thread (kimi_k3.kernels.subnormals): once KDA's "
                          "decays are strong, its chunk kernel runs up to 2x faster on x86; results differ only where "
                          "a value would have been subnormal."},
    )
    qk_clip_tau: str = field(
        default=DEFAULT_QK_CLIP_TAU,
        metadata={"help": "QK-Clip threshold on every MLA head's max attention logit after each optimizer step "
                          "(K2's 100); 0 or none turns QK-Clip off."},
    )
    qat: str | None = field(
        default=None,
        metadata={"help": "Quantization-aware training: routed experts' weights fake-quantized to this format in every "
                          "forward, straight-through gradients to the fp32 master weights.",
                  "choices": WEIGHT_FORMATS},
    )
    qat_activations: str = field(
        default="none",
        metadata={"help": "With --qat, also fake-quantize the experts' input activations (mxfp8: E4M3, per-32 scales).",
                  "choices": ACTIVATION_FORMATS},
    )
    final_layout: str = field(
        default="ours",
        metadata={"help": "Layout of the final model/ folder: ours (save_pretrained, fp32 master weights) or released "
                          "(MXFP4 experts, what a --qat run evaluated).",
                  "choices": FINAL_LAYOUTS},
    )
    reinitialize_missing_trainer_state: bool = field(
        default=False,
        metadata={"help": "Resume a checkpoint that lacks optimizer.pt, scheduler.pt or its RNG state, starting them "
                          "afresh (with a warning); without it such a checkpoint is refused."},
    )
    expert_merging_every_n_steps: int = field(
        default=0,
        metadata={"help": "Every N optimizer steps, merge each MoE layer's most similar pair of routed experts and "
                          "re-initialise the freed slot as a split of the most loaded expert (0: never)."},
    )
    expert_merging_threshold: float = field(
        default=0.9,
        metadata={"help": "With --expert_merging_every_n_steps: the cosine similarity of two experts' weights at which "
                          "they merge, in [-1, 1]."},
    )
    expert_merging_max_per_layer: int = field(
        default=1, metadata={"help": "With --expert_merging_every_n_steps: at most this many merges per layer and round."}
    )


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Train on this dataset (`datasets.load_dataset`): a hub id, one already in the datasets "
                          "cache (found by name offline with HF_HUB_OFFLINE=1), or a local folder of data files or "
                          "of `save_to_disk`. Its validation split is used if it has one. Not with --data_files."},
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "Configuration of --dataset_name, for datasets that have several."}
    )
    data_files: list[str] | None = field(
        default=None,
        metadata={"help": "Text (one document per paragraph), JSON(-lines), CSV or parquet files, also .gz/.bz2/.xz "
                          "compressed, or glob patterns such as 'data/*.txt' (quoted); or one `save_to_disk` folder. "
                          "Default without --dataset_name: embedded Python documentation."},
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the documents."})
    validation_split_percentage: float = field(
        default=5.0,
        metadata={"help": "Share of documents held out for evaluation when there is no validation split: drawn at "
                          "random (fixed seed), or with --streaming at evenly spaced positions (5: every 20th)."},
    )
    block_size: int = field(default=128, metadata={"help": "Tokens per training sequence."})
    packing: str = field(
        default="documents",
        metadata={"help": "documents: blocks keep their document boundaries (position ids restart, and every "
                          "document starts from a fresh model state); concatenate: blocks run across documents, "
                          "each seeing its neighbours' context.", "choices": PACKING_MODES},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "Read the data as a stream (`IterableDataset`), packed into blocks on the fly, read in order "
                          "and from the start again when it ends; needs --max_steps. A new tokenizer learns from the "
                          f"first {STREAM_TOKENIZER_DOCUMENTS:,} training documents. --resume_from_checkpoint "
                          "reads the stream again from its start and skips the batches already trained on, so it "
                          "continues exactly as long as the source is unchanged."},
    )
    max_eval_samples: int | None = field(
        default=None,
        metadata={"help": "Evaluate on the first this many validation blocks only; default all of them, or with "
                          f"--streaming the first {STREAM_EVAL_BLOCKS}, read once at the start, so that "
                          "evaluation ends."},
    )


@dataclass
class CardArguments:
    license: str | None = field(
        default=None,
        metadata={"help": "License of the model card: a hub identifier (apache-2.0, mit, ...) or `other` with "
                          "--license_name and --license_link; default: a fine-tuned model keeps its base model's "
                          "license (the K3 release's for moonshotai/Kimi-K3), a new model declares none."},
    )
    license_name: str | None = field(
        default=None, metadata={"help": "Name of a custom license (--license other), e.g. my-license-1.0."}
    )
    license_link: str | None = field(
        default=None, metadata={"help": "URL of a custom license's text (--license other)."}
    )
    language: list[str] | None = field(
        default=None,
        metadata={"help": "ISO 639 codes of the training text's languages, for the model card; default: en for the "
                          "embedded corpus, none for --data_files."},
    )
    dataset_ids: list[str] | None = field(
        default=None,
        metadata={"help": "Hub ids of the datasets the training text was taken from, listed in the model card (the "
                          "text still comes from --data_files or --dataset_name); default: --dataset_name when it is "
                          "a hub id."},
    )


class Publish(NamedTuple):
    """Where the final model goes when the run ends with a push."""

    repo_id: str
    token: str
    revision: str | None
    private: bool | None


class UsageError(ValueError):
    """Arguments that contradict each other or the state of the output folder."""


def parse_args(argv: list[str] | None) -> tuple[ModelArguments, DataArguments, CardArguments, TrainingArguments]:
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, CardArguments, TrainingArguments), prog="kimi-k3-train",
        epilog="With --image_text_dataset the command is the vision-language job, with options of its own: "
               "kimi-k3-train --image_text_dataset shapes --help lists them.",
    )  # fmt: skip
    parser.set_defaults(**TRAINING_DEFAULTS)
    # HfArgumentParser gives a boolean's `--no_*` complement the field's own help text; say what the switch does.
    complements = {
        "--no_quantile_balancing": "Leave the router bias alone (loads are still logged).",
        "--no_fused_situ": "Train with the model's eager SiTU-GLU (no torch.compile).",
        "--no_fused_attention_residuals": "Train with the model's eager Block AttnRes (no torch.compile).",
        "--no_sorted_experts": "Train with the model's own experts implementation (by default transformers' grouped_mm).",
    }
    for action in parser._actions:
        for option in set(action.option_strings) & complements.keys():
            action.help = complements[option]
    model_args, data_args, card_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    choose_optimizer(model_args, training_args, sys.argv[1:] if argv is None else argv)
    choose_router_balancing(model_args)
    return model_args, data_args, card_args, training_args


def choose_optimizer(model_args: ModelArguments, training_args: TrainingArguments, argv: list[str]) -> None:
    """--optimizer from the command line: Per-Head Muon by default, Trainer's optimizer when --optim is given alone;
    --optim with Per-Head Muon, which replaces Trainer's optimizer, is refused rather than ignored."""
    optim_given = any(arg == "--optim" or arg.startswith("--optim=") for arg in argv)
    if model_args.optimizer is None:
        model_args.optimizer = "adamw" if optim_given else "per_head_muon"
    elif model_args.optimizer != "adamw" and optim_given:
        raise UsageError(
            f"--optim {training_args.optim.value} chooses Trainer's optimizer, which --optimizer {model_args.optimizer} "
            f"replaces: pass --optimizer adamw (or --optim alone) to train with {training_args.optim.value}, or drop "
            "--optim"
        )


def choose_router_balancing(model_args: ModelArguments) -> None:
    """--router_balancing, quantile by default; --no_quantile_balancing means none, and contradicting it is refused."""
    if model_args.router_balancing is None:
        model_args.router_balancing = "quantile" if model_args.quantile_balancing else "none"
    elif not model_args.quantile_balancing and model_args.router_balancing != "none":
        raise UsageError(
            f"--no_quantile_balancing leaves the router bias alone, and --router_balancing {model_args.router_balancing} "
            "moves it: pass one of them"
        )
    model_args.quantile_balancing = model_args.router_balancing == "quantile"


def check_balancing(model_args: ModelArguments) -> None:
    for flag in ("sign_balancing_gamma", "aux_loss_alpha"):
        value = getattr(model_args, flag)
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{flag} must be a finite number >= 0, got {value}")
    if model_args.router_balancing == "sign" and model_args.sign_balancing_gamma == 0:
        raise UsageError("--router_balancing sign needs --sign_balancing_gamma > 0 (DeepSeek-V3: 1e-3), got 0")


def check_batch_sizes(training_args: TrainingArguments) -> None:
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(training_args, name)
        if value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")


# What `from_pretrained` loads weights from, in a saved folder.
MODEL_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")


def check_local_sources(model_args: ModelArguments) -> None:
    """A model or tokenizer argument that reads as a local path must exist: it is never fetched from the hub under
    that name. A hub id is ``NAME`` or ``OWNER/NAME`` with no folder ``OWNER`` here."""
    for flag in ("model_name_or_path", "tokenizer_name_or_path"):
        value = getattr(model_args, flag)
        if value is None or Path(value).expanduser().exists():
            continue
        if not is_repo_id(value) or ("/" in value and Path(Path(value).parts[0]).is_dir()):
            raise UsageError(f"--{flag} {value}: no such folder (a local path is never looked up on the hub)")
    check_source_folders(model_args)


def check_source_folders(model_args: ModelArguments) -> None:
    """A local folder to fine-tune holds weights, the folder the tokenizer comes from a ``tokenizer.json``, and both
    only regular files inside them of bounded size (`check_local_folder`), before anything is read from them."""
    model = model_args.model_name_or_path
    if model is not None and Path(model).expanduser().is_dir():
        folder = Path(model).expanduser()
        if not any((folder / name).exists() for name in MODEL_WEIGHT_FILES):
            raise UsageError(f"--model_name_or_path {model}: no weights ({' or '.join(MODEL_WEIGHT_FILES)}); "
                             "fine-tune from a saved model folder (a run's model/ or checkpoint-N)")
        refused_as_usage("model_name_or_path", check_local_folder, folder)
    flag = "tokenizer_name_or_path" if model_args.tokenizer_name_or_path else "model_name_or_path"
    tokenizer = getattr(model_args, flag)
    if tokenizer is not None and Path(tokenizer).expanduser().is_dir():
        folder = Path(tokenizer).expanduser()
        if not (folder / "tokenizer.json").exists():
            raise UsageError(f"--{flag} {tokenizer}: no tokenizer.json; pass --tokenizer_name_or_path with a folder "
                             "that has one")
        refused_as_usage(flag, checked_regular_file, folder / "tokenizer.json", folder_root(folder), MAX_JSON_FILE_BYTES)


def refused_as_usage(flag: str, check, *args) -> None:
    """``check(*args)``, its one-line refusal naming the option."""
    try:
        check(*args)
    except ValueError as error:
        raise UsageError(f"--{flag}: {error}") from None


def check_learning_rate(training_args: TrainingArguments) -> None:
    """A NaN or infinite rate would train into non-finite weights from the first step."""
    rate = training_args.learning_rate
    if not math.isfinite(rate) or rate < 0:
        raise UsageError(f"--learning_rate must be a finite number >= 0, got {rate}")


def check_data_limits(data_args: DataArguments, training_args: TrainingArguments) -> None:
    """A stream has no length to count epochs in, and --max_eval_samples bounds a non-empty evaluation."""
    if data_args.streaming and training_args.max_steps <= 0:
        raise UsageError(
            "--streaming needs --max_steps > 0 (a stream has no length to count epochs in), "
            f"got {training_args.max_steps}"
        )
    if data_args.max_eval_samples is not None and data_args.max_eval_samples < 1:
        raise UsageError(
            f"--max_eval_samples must be >= 1 (or left out for all blocks), got {data_args.max_eval_samples}"
        )


def check_world_size(training_args: TrainingArguments) -> None:
    """Refuse a launch whose processes Trainer would not join: each would train its own model into one folder.

    ``accelerate launch`` with the multi-GPU (DDP) config starts WORLD_SIZE processes on any machine, but without GPUs
    Trainer only joins them (over gloo) when told ``--use_cpu True``.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size == 1:
        raise UsageError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Trainer sees a world size of 1, "
            "so each process would train alone; on a machine without GPUs pass --use_cpu True"
        )


def publish_settings(training_args: TrainingArguments) -> Publish | None:
    """Where and how the run ends with a push, checked before any training; ``--hub_model_id`` implies it.

    Trainer's own push is switched off: it would upload checkpoints with the generic card.
    """
    if not (training_args.push_to_hub or training_args.hub_model_id):
        return None
    repo_id = training_args.hub_model_id or Path(training_args.output_dir).name
    check_repo_id(repo_id, named=training_args.hub_model_id is not None)
    token = hub.resolve_token(training_args.hub_token)
    hub.check_token(token, repo_id)
    training_args.push_to_hub = False
    return Publish(repo_id, token, training_args.hub_revision, training_args.hub_private_repo)


def check_repo_id(repo_id: str, named: bool) -> None:
    """Checked before training: the hub would refuse the push only after the run."""
    if not is_repo_id(repo_id):
        source = f"--hub_model_id {repo_id!r}" if named else f"--push_to_hub: the name of --output_dir, {repo_id!r},"
        raise UsageError(
            f"{source} is not a hub repository id (NAME or OWNER/NAME of letters, digits, '-', '_' and '.', at most "
            "96 characters, no '--' or '..'); pass a valid --hub_model_id"
        )


def card_settings(card_args: CardArguments, model_args: ModelArguments, data_args: DataArguments) -> dict[str, object]:
    """The model card's hub metadata (`card_metadata`), checked before any training; the embedded corpus is English,
    and a --dataset_name that is a hub id is the card's dataset."""
    embedded = not (data_args.data_files or data_args.dataset_name)
    language = card_args.language or (["en"] if embedded else None)
    named = hub_repo_id(data_args.dataset_name)
    dataset_ids = card_args.dataset_ids or ([named] if named else None)
    return card_metadata(
        model_args.model_name_or_path, card_args.license, card_args.license_name, card_args.license_link, language,
        dataset_ids,
    )  # fmt: skip


def resolve_checkpoint(training_args: TrainingArguments) -> str | None:
    """The checkpoint to resume (``True``/``last``: the newest in --output_dir); a fresh run needs a clean folder."""
    output_dir = training_args.output_dir
    requested = training_args.resume_from_checkpoint
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if requested is None:
        if last is not None:
            raise UsageError(
                f"--output_dir {output_dir} already holds checkpoints of another run ({last}); pass "
                "--resume_from_checkpoint True to continue it, or choose a new --output_dir"
            )
        return None
    checkpoint = last if requested.lower() in ("true", "last") else requested
    if checkpoint is None:
        raise UsageError(f"--resume_from_checkpoint {requested}: no checkpoint-N folder in {output_dir}")
    if not os.path.isfile(os.path.join(checkpoint, "trainer_state.json")):
        raise UsageError(f"--resume_from_checkpoint {requested}: {checkpoint} is not a Trainer checkpoint folder")
    return checkpoint


def config_overrides(text: str | None) -> dict:
    """The --config_overrides object; a field KimiK3Config does not have is an error naming the closest one."""
    if not text:
        return {}
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"--config_overrides is not valid JSON ({error}): {text!r}") from None
    if not isinstance(overrides, dict):
        raise UsageError(f"--config_overrides must be a JSON object, got {text!r}")
    known = set(KimiK3Config.__dataclass_fields__) | set(KimiK3Config().to_dict()) | set(KimiK3Config.attribute_map)
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"--config_overrides: KimiK3Config has no field {name!r}{hint}")
    return overrides


def check_expert_merging(model_args: ModelArguments) -> None:
    every_n_steps = model_args.expert_merging_every_n_steps
    if every_n_steps < 0:
        raise UsageError(f"--expert_merging_every_n_steps must be >= 0 (0: never), got {every_n_steps}")
    if every_n_steps:
        flags = ("--expert_merging_every_n_steps", "--expert_merging_threshold", "--expert_merging_max_per_layer")
        check_merging_arguments(every_n_steps, model_args.expert_merging_threshold,
                                model_args.expert_merging_max_per_layer, names=flags)


def check_block_size(block_size: int, config: KimiK3Config) -> None:
    if block_size > config.max_position_embeddings:
        raise DataError(
            f"--block_size {block_size} exceeds the model's max_position_embeddings ({config.max_position_embeddings})"
        )


def parse_qk_clip_tau(value: str) -> float | None:
    """--qk_clip_tau as a threshold > 0, or None (QK-Clip off) for ``0`` / ``none``."""
    if value.strip().lower() == "none":
        return None
    try:
        tau = float(value)
        if tau != 0:
            check_tau(tau)
    except ValueError:
        raise UsageError(
            f"--qk_clip_tau must be a number > 0 (default {DEFAULT_QK_CLIP_TAU}), or 0 / none to turn QK-Clip off; "
            f"got {value!r}"
        ) from None
    return tau or None
