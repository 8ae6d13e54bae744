"""Pre-train or fine-tune a Kimi K3 model with ``transformers.Trainer``: ``kimi-k3-train`` / ``scripts/train.py``.

``main`` reads top-down: arguments -> data -> tokenizer -> model -> optimizer and callbacks -> Trainer -> save, card,
push. The defaults train the default ``KimiK3Config()`` on the embedded corpus in a few minutes on a 2-core CPU with
Per-Head Muon and Quantile Balancing. Every ``TrainingArguments`` option can be given on the command line.
"""

import difflib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import datasets
import torch
from accelerate.utils import broadcast_object_list
from safetensors import safe_open
from transformers import HfArgumentParser, Trainer, TrainerState, TrainingArguments, default_data_collator, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from checkpoint_format_kimi_k3 import verify_checkpoint_files
from configuration_kimi_k3 import VARIANT_FIELDS_OFF, KimiK3Config
from modeling_kimi_k3 import KimiK3ForCausalLM

from . import expert_load, hub, run_folder
from .balance_metrics import load_balance_metrics
from .data import (
    PACKING_MODES,
    STREAM_EVAL_BLOCKS,
    STREAM_TOKENIZER_DOCUMENTS,
    DataError,
    evaluation_blocks,
    load_corpus,
    tokenize_into_blocks,
    tokenizer_documents,
)
from .distributed import load_full_state_dict
from .expert_load import ExpertLoadRecorder
from .expert_merging import ExpertMergingCallback, check_merging_arguments
from .fused_situ import use_fused_situ
from .model_card import TrainingSummary, card_metadata, hub_repo_id, render_model_card
from .muon import PerHeadMuonFactory
from .precision import PRECISION_CHOICES, warn_if_bf16_is_emulated
from .qat import ACTIVATION_FORMATS, WEIGHT_FORMATS, attach_qat, check_mxfp4_widths, find_routed_experts
from .qk_clip import QKClipCallback, check_tau
from .padding import masked_counts
from .quantile_balancing import QuantileBalancingCallback, find_routers
from .resumable import ResumableCallback, TrainingClock
from .release_format import check_exportable, checkpoint_shard_files, export_released
from .tokenizer import check_tokenizer_fits, load_tokenizer, train_bpe_tokenizer

OPTIMIZERS = ("per_head_muon", "adamw")
FINAL_LAYOUTS = ("ours", "released")
# K2's published QK-Clip threshold, which K3 keeps.
DEFAULT_QK_CLIP_TAU = "100"
FINAL_MODEL_DIR = "model"
# Written into every checkpoint: what a resume compares its own global batch with.
BATCH_FILE = "batch_size.json"
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
    optimizer: str = field(
        default="per_head_muon",
        metadata={"help": "per_head_muon (Muon for matrices, AdamW for the rest) or adamw (TrainingArguments.optim).",
                  "choices": OPTIMIZERS},
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
    fused_situ: bool = field(
        default=True,
        metadata={"help": "Compile SiTU-GLU and its backward into one kernel each (torch.compile, once per process); "
                          "--no_fused_situ trains with the model's eager reference."},
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
    final_layout: str = field(
        default="ours",
        metadata={"help": "Layout of the final model/ folder: ours (save_pretrained, fp32 master weights) or released "
                          "(MXFP4 experts, what a --qat run evaluated).",
                  "choices": FINAL_LAYOUTS},
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


class SaveError(RuntimeError):
    """Writing a checkpoint or the final model failed; nothing partial was published."""


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------
class KimiK3Trainer(Trainer):
    """``Trainer`` whose checkpoints appear atomically, also load into models sharded at load time, and whose
    evaluations report perplexity."""

    _staging_run_dir: Path | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # One tag per job, the same on every rank: all ranks write their RNG state into one staging folder.
        self.staging_tag = broadcast_object_list([run_folder.new_tag()])[0]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "eval_loss" in logs:
            logs["eval_perplexity"] = perplexity(logs["eval_loss"])
        super().log(logs, start_time)

    def _get_output_dir(self, trial) -> str:
        if self._staging_run_dir is not None:
            return str(self._staging_run_dir)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """Write ``checkpoint-N`` under a hidden staging folder unique to this job, fsync it and rename it into place.

        A failure midway (a full disk, a kill) leaves no ``checkpoint-N`` behind, so ``--resume_from_checkpoint True``
        still finds the previous, complete one; the failure surfaces as one `SaveError`.
        """
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = run_dir / run_folder.staging_name(name, self.staging_tag)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_run_dir = staging
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                write_batch_size(self.args, staging / name / BATCH_FILE)
                self._publish_checkpoint(staging / name, run_dir / name)
        except Exception as error:
            raise SaveError(save_failure(name, run_dir, error)) from error
        finally:
            self._staging_run_dir = None
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)

    def _publish_checkpoint(self, staged: Path, target: Path) -> None:
        best = self.state.best_model_checkpoint
        if best is not None and Path(best) == staged:
            # The best checkpoint was recorded under its staging path; point the state at its final place.
            self.state.best_model_checkpoint = str(target)
            self.state.save_to_json(str(staged / "trainer_state.json"))
        run_folder.replace_folder(staged, target)
        rotate_checkpoints(
            output_dir=str(target.parent),
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Refuse a checkpoint that does not hold exactly the model's tensors (`from_pretrained`'s own check): Trainer
        would otherwise only warn and train on with, say, a freshly initialised ``lm_head``."""
        verify_checkpoint_files(model or self.model, checkpoint_shard_files(Path(resume_from_checkpoint)))
        if self.is_distributed_loading_by_transformers:
            self._load_into_shards(resume_from_checkpoint)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if self.is_distributed_loading_by_transformers:
            self._load_into_shards(self.state.best_model_checkpoint)
        else:
            super()._load_best_model()

    def _load_into_shards(self, checkpoint: str) -> None:
        """Checkpoint weights into a model sharded at load time (``DistributedConfig``), every rank keeping its shard.

        Trainer's own loader copies plain tensors into the ``DTensor`` parameters, which fails. Each rank reads the
        whole checkpoint through ``from_pretrained`` (any saved layout, strict).
        """
        saved = type(self.model).from_pretrained(checkpoint, config=self.model.config)
        load_full_state_dict(self.model, saved.state_dict())


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def save_failure(name: str, folder: Path, error: BaseException) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    full = " (the disk is full)" if run_folder.is_disk_full(error) else ""
    return f"saving {name} in {folder} failed{full}: {reason}; nothing partial was published"


def write_batch_size(args: TrainingArguments, path: Path) -> None:
    path.write_text(json.dumps(batch_size(args)) + "\n")


def batch_size(args: TrainingArguments) -> dict[str, int]:
    per_device, accumulation, processes = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size
    return {
        "global": per_device * accumulation * processes,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "processes": processes,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Steps of main()
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> tuple[ModelArguments, DataArguments, CardArguments, TrainingArguments]:
    parser = HfArgumentParser((ModelArguments, DataArguments, CardArguments, TrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    # HfArgumentParser gives a boolean's `--no_*` complement the field's own help text; say what the switch does.
    complements = {
        "--no_quantile_balancing": "Leave the router bias alone (loads are still logged).",
        "--no_fused_situ": "Train with the model's eager SiTU-GLU (no torch.compile).",
    }
    for action in parser._actions:
        for option in set(action.option_strings) & complements.keys():
            action.help = complements[option]
    return parser.parse_args_into_dataclasses(args=argv)


def check_batch_sizes(training_args: TrainingArguments) -> None:
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(training_args, name)
        if value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")


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

    Trainer's own push is switched off: it would upload checkpoints with the generic card (hf-integration.md §1.5).
    """
    if not (training_args.push_to_hub or training_args.hub_model_id):
        return None
    token = hub.resolve_token(training_args.hub_token, hub.TRAINING_FLAGS)
    repo_id = training_args.hub_model_id or Path(training_args.output_dir).name
    training_args.push_to_hub = False
    return Publish(repo_id, token, training_args.hub_revision, training_args.hub_private_repo)


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


def build_tokenizer(model_args: ModelArguments, train_split, checkpoint: str | None):
    """The resumed checkpoint's tokenizer, else the one given, else the fine-tuned model's, else a new BPE."""
    source = checkpoint or model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if source is not None:
        return load_tokenizer(source)
    return train_bpe_tokenizer(tokenizer_documents(train_split), model_args.tokenizer_vocab_size)


def build_model(model_args: ModelArguments, tokenizer, checkpoint: str | None,
                qk_clip_tau: float | None) -> KimiK3ForCausalLM:
    """A new model sized by the tokenizer, the fine-tuned folder, or the resumed checkpoint's architecture.

    A resumed model gets its weights from Trainer's checkpoint loading, together with the optimizer state.
    """
    overrides = config_overrides(model_args.config_overrides)
    if checkpoint is not None:
        model = KimiK3ForCausalLM(KimiK3Config.from_pretrained(checkpoint, **overrides))
    elif model_args.model_name_or_path is not None:
        model = KimiK3ForCausalLM.from_pretrained(model_args.model_name_or_path, **overrides)
    else:
        token_ids = {
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
        model = KimiK3ForCausalLM(KimiK3Config(**{**token_ids, **overrides}))
    check_tokenizer_fits(tokenizer, model.config)
    if model_args.fused_situ:
        use_fused_situ(model)
    if qk_clip_tau is not None and not model.config.mla_layer_indices:
        raise UsageError(
            f"--qk_clip_tau {model_args.qk_clip_tau}: QK-Clip rescales MLA heads but the model has no MLA "
            "(full_attention) layer; pass --qk_clip_tau none"
        )
    return model


def attach_expert_qat(model_args: ModelArguments, model: KimiK3ForCausalLM) -> None:
    """Fake-quantize the routed experts in every forward when --qat is given (kimi_k3.qat); checked before training,
    as is a released final layout, which needs MXFP4-groupable expert widths."""
    if model_args.final_layout == "released":
        check_exportable(model.config, "--final_layout released")
        check_mxfp4_widths(find_routed_experts(model), "--final_layout released")
    if model_args.qat is None:
        if model_args.qat_activations != "none":
            raise UsageError(f"--qat_activations {model_args.qat_activations} needs --qat {WEIGHT_FORMATS[0]}")
        return
    attach_qat(model, model_args.qat, model_args.qat_activations)


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
    known = set(KimiK3Config().to_dict()) | set(KimiK3Config.attribute_map) | set(VARIANT_FIELDS_OFF)
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"--config_overrides: KimiK3Config has no field {name!r}{hint}")
    return overrides


def check_block_size(block_size: int, config: KimiK3Config) -> None:
    if block_size > config.max_position_embeddings:
        raise DataError(
            f"--block_size {block_size} exceeds the model's max_position_embeddings ({config.max_position_embeddings})"
        )


def check_resumable(model, checkpoint: str, training_args: TrainingArguments) -> None:
    """The checkpoint must hold exactly the model's tensors; a changed global batch is allowed but announced."""
    verify_checkpoint_files(model, checkpoint_shard_files(Path(checkpoint)))
    saved = Path(checkpoint) / BATCH_FILE
    if not saved.is_file():
        return
    old, new = json.loads(saved.read_text()), batch_size(training_args)
    if old["global"] != new["global"]:
        print(
            f"kimi-k3-train: warning: resuming {checkpoint} with global batch {new['global']} "
            f"({describe_batch(new)}); it was trained with {old['global']} ({describe_batch(old)}), so the data order "
            "and the optimizer trajectory differ from the original run",
            file=sys.stderr,
        )


def describe_batch(batch: dict[str, int]) -> str:
    return (
        f"{batch['per_device_train_batch_size']} per device x {batch['gradient_accumulation_steps']} accumulation "
        f"x {batch['processes']} processes"
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


def optimizer_and_callbacks(model_args: ModelArguments, training_args: TrainingArguments, model,
                            qk_clip_tau: float | None):
    """Per-Head Muon through Trainer's optimizer-factory hook (or Trainer's own AdamW), the balancing callback and
    QK-Clip (inside Per-Head Muon's step, or as a callback after AdamW's), whose statistics join the logs, and the
    recorder of expert loads for the card's picture."""
    optimizer_cls_and_kwargs = None
    if model_args.optimizer == "per_head_muon":
        optimizer_cls_and_kwargs = PerHeadMuonFactory.from_training_args(
            training_args, ns_dtype=model_args.muon_ns_dtype, qk_clip_tau=qk_clip_tau
        )
    callbacks = []
    if qk_clip_tau is not None:
        callbacks.append(QKClipCallback(None if optimizer_cls_and_kwargs else qk_clip_tau))
    if find_routers(model):
        update_rule = "quantile" if model_args.quantile_balancing else "none"
        balancing = QuantileBalancingCallback(model, update_rule=update_rule, per_layer_metrics=False)
        callbacks += [balancing, ExpertLoadRecorder(balancing)]
        if model_args.expert_merging_every_n_steps:
            callbacks.append(ExpertMergingCallback(
                balancing, model_args.expert_merging_every_n_steps, model_args.expert_merging_threshold,
                model_args.expert_merging_max_per_layer, seed=training_args.seed,
            ))  # fmt: skip
    elif model_args.expert_merging_every_n_steps:
        raise UsageError("--expert_merging_every_n_steps merges routed experts, and the model has none (num_experts)")
    return optimizer_cls_and_kwargs, callbacks


def check_expert_merging(model_args: ModelArguments) -> None:
    every_n_steps = model_args.expert_merging_every_n_steps
    if every_n_steps < 0:
        raise UsageError(f"--expert_merging_every_n_steps must be >= 0 (0: never), got {every_n_steps}")
    if every_n_steps:
        flags = ("--expert_merging_every_n_steps", "--expert_merging_threshold", "--expert_merging_max_per_layer")
        check_merging_arguments(every_n_steps, model_args.expert_merging_threshold,
                                model_args.expert_merging_max_per_layer, names=flags)


def build_trainer(model, tokenizer, blocks, training_args, optimizer_cls_and_kwargs, callbacks) -> KimiK3Trainer:
    train_blocks = blocks["train"]
    if isinstance(train_blocks, datasets.IterableDataset):
        # Endless, so Trainer never starts a second epoch of an unsized stream: a resume then skips its trained batches
        # within one deterministic pass and lands where the interrupted run was, however often the stream wrapped.
        train_blocks = train_blocks.repeat(None)
    return KimiK3Trainer(
        model=model,
        args=training_args,
        train_dataset=train_blocks,
        eval_dataset=blocks["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        callbacks=callbacks,
    )


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
        optimizer="Per-Head Muon + AdamW" if model_args.optimizer == "per_head_muon" else f"AdamW ({args.optim})",
        learning_rate=args.learning_rate,
        router_balancing="quantile_balancing" if model_args.quantile_balancing else "none",
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
    )


def describe_qat(model_args: ModelArguments) -> str:
    if model_args.qat is None:
        return "none"
    activations = "full precision" if model_args.qat_activations == "none" else model_args.qat_activations.upper()
    return f"{model_args.qat.upper()} routed experts (activations: {activations})"


def describe_weights_on_disk(model_args: ModelArguments, model) -> str:
    if model_args.final_layout == "released":
        return "released layout, MXFP4 routed experts"
    return f"this project's layout, {str(model.dtype).removeprefix('torch.')}"


def describe_qk_clip(model_args: ModelArguments) -> str:
    tau = parse_qk_clip_tau(model_args.qk_clip_tau)
    return "off" if tau is None else f"tau = {tau:g}"


def local_folder_name(model_dir: Path) -> str:
    """How the card's usage snippet names the saved folder: relative to the working directory the job ran in, or,
    for a folder outside it, a placeholder the card explains (an absolute path would publish the disk's layout)."""
    relative = Path(os.path.relpath(model_dir.resolve(), Path.cwd().resolve()))
    return "path/to/model" if relative.parts[:1] == ("..",) else relative.as_posix()


def save_final_model(model, tokenizer, card, target: Path, tag: str | None = None, layout: str = "ours",
                     files: dict[str, bytes] | None = None) -> Path:
    """Model, code, tokenizer, card and ``files`` (name -> content, e.g. the card's picture) written to a unique
    sibling staging folder, then swapped in (see `run_folder.replace_folder`); a failure raises `SaveError` and leaves
    any previous ``target`` whole.

    ``layout="released"`` converts the staged folder to the released layout (MXFP4 experts) before the swap; the
    model's parameters are the master weights either way (QAT never changes them).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = tag or run_folder.new_tag()
    staging = target.with_name(run_folder.staging_name(target.name, tag))
    released = target.with_name(run_folder.staging_name(f"{target.name}-released", tag))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        card.save(staging / "README.md")
        for name, content in (files or {}).items():
            (staging / name).write_bytes(content)
        if layout == "released":
            export_released(staging, released, progress=False)
        run_folder.replace_folder(released if layout == "released" else staging, target)
    except Exception as error:
        raise SaveError(save_failure(target.name, target.parent, error)) from error
    finally:
        for folder in (staging, released):
            shutil.rmtree(folder, ignore_errors=True)
    return target


def finished_step(checkpoint: str | None, training_args: TrainingArguments) -> int | None:
    """The checkpoint's step when it already reached the run's end (--max_steps, else the step count it recorded)."""
    if checkpoint is None:
        return None
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    last_step = training_args.max_steps if training_args.max_steps > 0 else state["max_steps"]
    return state["global_step"] if state["global_step"] >= last_step else None


def same_weights(first: Path, second: Path) -> bool:
    """Both folders hold the same tensors, bit for bit (read one tensor at a time)."""
    try:
        files = [checkpoint_shard_files(folder) for folder in (first, second)]
    except ValueError:
        return False
    handles = [[safe_open(path, framework="pt") for path in paths] for paths in files]
    tensors = [{name: handle for handle in group for name in handle.keys()} for group in handles]
    if tensors[0].keys() != tensors[1].keys():
        return False
    return all(torch.equal(tensors[0][name].get_tensor(name), tensors[1][name].get_tensor(name)) for name in tensors[0])


def claim_output_folder(training_args: TrainingArguments) -> run_folder.OutputFolderLock | None:
    """Lock --output_dir for this job (on the first process; every rank learns the outcome), then undo what a killed
    job left half done there. Everything the job decides from the folder's contents comes after this."""
    lock, refusal = None, None
    if training_args.process_index == 0:
        try:
            lock = run_folder.OutputFolderLock(training_args.output_dir).acquire()
        except ValueError as error:
            refusal = str(error)
        else:
            restored = run_folder.recover_replacements(Path(training_args.output_dir))
            if restored:
                print(f"kimi-k3-train: restored {', '.join(restored)} left mid-replacement by a killed job")
    refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        raise UsageError(refusal)
    return lock


def print_report(summary: TrainingSummary, model_dir: Path) -> None:
    print(
        f"first training loss {summary.first_loss:.4f} -> last {summary.last_loss:.4f}; "
        f"final eval loss {summary.eval_loss:.4f}, eval perplexity {summary.eval_perplexity:.2f}; "
        f"{summary.steps} steps in {summary.wall_time_s:.0f} s; model saved to {model_dir}"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the job. Bad input exits with status 2 and a one-line message, before anything is written (a bad row deep
    in a stream: when it is read); a failed save exits with status 1 and a one-line message, publishing nothing
    partial."""
    start = time.perf_counter()
    datasets.disable_progress_bars()
    lock = None
    try:
        try:
            model_args, data_args, card_args, training_args = parse_args(argv)
            check_batch_sizes(training_args)
            check_expert_merging(model_args)
            check_data_limits(data_args, training_args)
            check_world_size(training_args)
            warn_if_bf16_is_emulated(training_args.bf16, training_args.device)
            qk_clip_tau = parse_qk_clip_tau(model_args.qk_clip_tau)
            run_folder.check_writable(training_args.output_dir)
            publish = publish_settings(training_args)
            metadata = card_settings(card_args, model_args, data_args)
            lock = claim_output_folder(training_args)
            checkpoint = resolve_checkpoint(training_args)
            set_seed(training_args.seed)  # Trainer seeds only in its constructor, after the model is initialised

            splits, data_description = load_corpus(
                data_args.data_files, data_args.text_column, data_args.validation_split_percentage,
                dataset_name=data_args.dataset_name, dataset_config_name=data_args.dataset_config_name,
                streaming=data_args.streaming,
            )
            tokenizer = build_tokenizer(model_args, splits["train"], checkpoint)
            model = build_model(model_args, tokenizer, checkpoint, qk_clip_tau)
            attach_expert_qat(model_args, model)
            check_block_size(data_args.block_size, model.config)
            if checkpoint is not None:
                check_resumable(model, checkpoint, training_args)
            blocks = tokenize_into_blocks(splits, tokenizer, data_args.block_size, data_args.packing)
            blocks = {"train": blocks["train"], "validation": evaluation_blocks(blocks["validation"],
                                                                                data_args.max_eval_samples)}
            optimizer_cls_and_kwargs, callbacks = optimizer_and_callbacks(model_args, training_args, model, qk_clip_tau)
            callbacks.append(TrainingClock(start))
            trainer = build_trainer(model, tokenizer, blocks, training_args, optimizer_cls_and_kwargs, callbacks)
        except ValueError as error:
            print(f"kimi-k3-train: error: {error}", file=sys.stderr)
            return 2
        try:
            return run(trainer, model_args, data_args, blocks, data_description, checkpoint, publish, metadata)
        except DataError as error:  # a stream is checked as it is read
            print(f"kimi-k3-train: error: {error}", file=sys.stderr)
            return 2
        except SaveError as error:
            print(f"kimi-k3-train: error: {error}", file=sys.stderr)
            return 1
    finally:
        if lock is not None:  # also removes the folder when it was created here and nothing was written
            lock.release()


def evaluation_at_last_step(state: TrainerState) -> dict[str, float] | None:
    """The metrics of an evaluation the Trainer already ran at the final step (``max_steps`` a multiple of
    ``eval_steps``), so that the same weights are not evaluated twice."""
    for entry in reversed(state.log_history):
        if "eval_loss" in entry:
            return entry if entry.get("step") == state.global_step else None
    return None


def run(trainer, model_args, data_args, blocks, data_description, checkpoint, publish, metadata) -> int:
    """Train (or, when the checkpoint already ends the run, only load it), evaluate, then save the final model."""
    training_args = trainer.args
    model_dir = Path(training_args.output_dir) / FINAL_MODEL_DIR
    finished = finished_step(checkpoint, training_args)
    if finished is None:
        trainer.train(resume_from_checkpoint=checkpoint)
    elif same_weights(Path(checkpoint), model_dir):
        print(f"kimi-k3-train: the run already finished at step {finished} and {model_dir} holds its model; nothing to do")
        return 0
    else:  # killed while saving the final model: finish from the last checkpoint without training a step
        trainer._load_from_checkpoint(checkpoint)
        trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, ResumableCallback):
                callback.resume_from(trainer.state)
    eval_metrics = evaluation_at_last_step(trainer.state) or trainer.evaluate()
    if not trainer.is_world_process_zero():
        return 0

    layer_balance = measure_expert_load(trainer.model, blocks["validation"], training_args.per_device_eval_batch_size)
    summary = training_summary(trainer, model_args, data_description, blocks, data_args.block_size, eval_metrics,
                               data_args.packing)
    name = publish.repo_id if publish else Path(training_args.output_dir).name
    picture = expert_load_picture(trainer, name)
    card = render_model_card(trainer.model, name, summary, layer_balance, metadata,
                             expert_load.PNG_NAME if picture else None,
                             local_folder=None if publish else local_folder_name(model_dir))
    model_dir = save_final_model(
        trainer.model, trainer.processing_class, card, model_dir, trainer.staging_tag, model_args.final_layout,
        {expert_load.PNG_NAME: picture} if picture else None,
    )
    if picture:
        write_file_atomically(model_dir.parent / expert_load.PNG_NAME, picture, trainer.staging_tag)
    print_report(summary, model_dir)
    if publish:
        try:
            pushed = hub.push_folder(model_dir, publish.repo_id, hub.HfApi(token=publish.token),
                                     private=publish.private, revision=publish.revision, flags=hub.TRAINING_FLAGS)
        except hub.HubError as error:
            print(f"kimi-k3-train: error: {error}; {model_dir} is saved: publish it with "
                  f"`python scripts/push_to_hub.py {model_dir} --repo_id {publish.repo_id}`", file=sys.stderr)
            return 1
        print(f"pushed {model_dir} to {pushed}")
    return 0


def expert_load_picture(trainer: Trainer, title: str) -> bytes | None:
    """The card's expert-load picture (`kimi_k3.expert_load`); None for a model without routed experts, or, after one
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
    staged.write_bytes(content)
    os.replace(staged, path)
