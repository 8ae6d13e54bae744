"""The settings a run trained with, recorded in every checkpoint, and what a resume changes against them.

A resume restores the optimizer (its learning rate, betas, weight decay), the learning-rate schedule and the random
state from the checkpoint, so a new value of those settings would be ignored while the card claimed it, and a new
seed, data (by content), block size, packing, precision, loss or model setting (the config as the run recorded it,
so an edited checkpoint ``config.json`` shows too) would make the continuation differ from the run it claims to
continue. So every changed recorded setting is refused, all of them in one line; ``--max_steps`` (extending the run)
and the global batch (announced by `kimi_k3.job.trainer.check_resumable`) may change.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

from transformers import TrainingArguments

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.job.arguments import DataArguments, ModelArguments, UsageError
from kimi_k3.text.corpus import expand_data_files

RUN_SETTINGS_FILE = "run_settings.json"
TRAINING_SETTINGS = (
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "max_grad_norm", "seed", "data_seed",
    "bf16", "fp16", "tf32", "label_smoothing_factor", "optim_args", "neftune_noise_alpha", "torch_compile",
    "average_tokens_across_devices",
)  # fmt: skip
MODEL_SETTINGS = (
    "optimizer", "muon_ns_dtype", "quantile_balancing", "router_balancing", "sign_balancing_gamma", "aux_loss_alpha",
    "qk_clip_tau", "qat", "qat_activations", "flush_subnormals",
    "expert_merging_every_n_steps", "expert_merging_threshold", "expert_merging_max_per_layer",
)  # fmt: skip
DATA_SETTINGS = (
    "dataset_name", "dataset_config_name", "text_column", "validation_split_percentage", "block_size", "packing",
    "streaming",
)  # fmt: skip
# Bookkeeping a config carries that says nothing about the model.
UNCOMPARED_CONFIG_FIELDS = ("transformers_version", "_name_or_path", "architectures", "auto_map")


def run_settings(
    model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments, config: KimiK3Config
) -> dict:
    """JSON values of every recorded setting; data files by resolved path and content hash; the model config, so
    that an edit of a checkpoint's ``config.json`` shows against the run's."""
    settings = {name: getattr(training_args, name) for name in TRAINING_SETTINGS}
    settings |= {name: getattr(model_args, name) for name in MODEL_SETTINGS}
    settings |= {name: getattr(data_args, name) for name in DATA_SETTINGS}
    settings["data_files"] = data_file_hashes(data_args.data_files)
    settings["config"] = compared_config(config)
    return json.loads(json.dumps(settings, default=str))


def data_file_hashes(patterns: list[str] | None) -> dict[str, str] | None:
    """SHA-256 of each data file: an edit that keeps the size changes the data all the same."""
    if not patterns:
        return None
    files = [os.path.abspath(path) for path in expand_data_files(patterns)]
    return {path: file_sha256(path) if os.path.isfile(path) else "missing" for path in files}


def file_sha256(path: str) -> str:
    with open(path, "rb") as file:
        return "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()


def compared_config(config: KimiK3Config) -> dict:
    """The config's fields as recorded (JSON values), less bookkeeping."""
    fields = {name: value for name, value in config.to_dict().items() if name not in UNCOMPARED_CONFIG_FIELDS}
    return json.loads(json.dumps(fields, default=str))


def comparable_data_files(recorded, current):
    """Checkpoints written before content hashes recorded each file's size: compare those with sizes."""
    if not isinstance(recorded, dict) or not isinstance(current, dict):
        return current
    sized = {path: os.path.getsize(path) if os.path.isfile(path) else -1 for path in current}
    return sized if any(isinstance(value, int) for value in recorded.values()) else current


def encoded(settings: dict) -> bytes:
    return (json.dumps(settings, indent=1, sort_keys=True) + "\n").encode()


def changed_settings(recorded: dict, current: dict) -> list[str]:
    current = {**current, "data_files": comparable_data_files(recorded.get("data_files"), current.get("data_files"))}
    return [
        f"--{name} {describe(current.get(name))} (the run used {describe(recorded[name])})"
        for name in sorted(recorded)
        if recorded[name] != current.get(name)
    ]


def changed_config_fields(recorded: dict, current: dict) -> list[str]:
    return [
        f"config field {name} {describe(current.get(name))} (the run used {describe(recorded.get(name))})"
        for name in sorted(recorded.keys() | current.keys())
        if name not in UNCOMPARED_CONFIG_FIELDS and recorded.get(name) != current.get(name)
    ]


def check_unchanged(checkpoint: str, settings: dict, config: KimiK3Config) -> None:
    """Refuse a resume whose settings or model config differ from the checkpoint's recorded run, listing them all."""
    path = Path(checkpoint) / RUN_SETTINGS_FILE
    recorded = {}
    if path.is_file():
        try:
            recorded = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UsageError(f"{path} cannot be read ({error}); it records the run being resumed") from None
    # The run's own record of its config; older checkpoints have only their config.json.
    recorded_config = recorded.pop("config", None) or compared_config(KimiK3Config.from_pretrained(checkpoint))
    current = {name: value for name, value in settings.items() if name != "config"}
    changes = changed_settings(recorded, current) + changed_config_fields(recorded_config, compared_config(config))
    if not path.is_file():
        print(f"kimi-k3-train: warning: {checkpoint} records no {RUN_SETTINGS_FILE} (an older checkpoint), so only its "
              "model config and global batch are compared with this run's", file=sys.stderr)
    if changes:
        raise UsageError(
            f"--resume_from_checkpoint {checkpoint}: {'; '.join(changes)}; a resume restores the optimizer, the "
            "schedule and the random state of that run, so it continues exactly only with its settings: drop the "
            f"changes, or start a new run from its weights with --model_name_or_path {checkpoint}"
        )


def describe(value) -> str:
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
