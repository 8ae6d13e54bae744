"""The job's ``Trainer``: checkpoints that appear atomically and record their global batch, loading into models sharded
at load time, perplexity beside every evaluation loss."""

import json
import math
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, reduce
from transformers import Trainer, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from kimi_k3.checkpoint import run_folder
from kimi_k3.checkpoint.release_format import checkpoint_shard_files
from kimi_k3.checkpoint.finite import check_finite_files, first_non_finite
from kimi_k3.job.health import TrainingDiverged, check_finite_gradients, non_finite_weight_message
from kimi_k3.job.run_settings import RUN_SETTINGS_FILE, compared_config, encoded
from kimi_k3.job.resume_manifest import CheckpointFileError, first_line, rng_source, rng_state_names
from kimi_k3.parallel.sharding import load_full_state_dict
from kimi_k3.policies.callback import report_after_every_callback
from loading_kimi_k3 import verify_checkpoint_files

# Written into every checkpoint: what a resume compares its own global batch with.
BATCH_FILE = "batch_size.json"


class SaveError(RuntimeError):
    """Writing a checkpoint or the final model failed; nothing partial was published."""


class KimiK3Trainer(Trainer):
    """``Trainer`` whose checkpoints appear atomically, also load into models sharded at load time, and whose
    evaluations report perplexity.

    Seven private methods are overridden (each checked in tests/test_transformers_api.py) because the public surface
    has no seam there: callbacks run after a checkpoint is written (``on_save``), not around it;
    ``on_pre_optimizer_step`` gets no gradient norm, so checking one there would be a second pass over every gradient;
    and loading a checkpoint, the best model, the optimizer state or the RNG files has no hook at all.
    """

    _staging_run_dir: Path | None = None
    # What `kimi_k3.job.run_settings.check_unchanged` compares a resume with; the job sets it.
    run_settings: dict | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.full_determinism:
            skip_filling_uninitialized_memory()
        report_after_every_callback(self)  # so that --report_to integrations log the balance and QK-Clip metrics
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
        self._check_finite_weights(name)
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
                self._write_run_settings(staging / name)
                self._publish_checkpoint(staging / name, run_dir / name)
        except Exception as error:
            raise SaveError(save_failure(name, run_dir, error)) from error
        finally:
            self._staging_run_dir = None
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer's gradient norm, the clipping's or its own, checked before the optimizer step: a non-finite one ends
        the run (`check_finite_gradients`) without a second pass over the gradients to find out."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        check_finite_gradients(grad_norm, self.state.global_step + 1)
        return grad_norm

    def _check_finite_weights(self, checkpoint_name: str) -> None:
        """Every process stops together: under FSDP each checks its own shard, and one process's NaN stops all."""
        found = first_non_finite(self.model.named_parameters())
        flags = reduce(torch.tensor([float(found is not None)], device=self.args.device), reduction="sum")
        if found is None and float(flags.sum()) > 0:
            found = ("a weight on another process", "some")
        if found is not None:
            raise TrainingDiverged(non_finite_weight_message(*found, checkpoint_name))

    def _write_run_settings(self, checkpoint: Path) -> None:
        if self.run_settings is not None:  # the config as saved beside it: a policy may have changed it since
            settings = {**self.run_settings, "config": compared_config(self.model.config)}
            run_folder.write_new_file(checkpoint / RUN_SETTINGS_FILE, encoded(settings))

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

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Scheduler and RNG files were loaded once by `check_trainer_files`; what fails here is the optimizer's."""
        with failure_names_file(checkpoint, OPTIMIZER_NAME):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Trainer's restore, also from a checkpoint of another process count (`rng_source`): Trainer only looks
        for its own count's file name, so the mapped file is handed to it under that name."""
        own = rng_state_names(self.args)[self.args.process_index]
        source = rng_source(Path(checkpoint), self.args) if checkpoint is not None else None
        with failure_names_file(checkpoint, source or own):
            if source is None or source == own:
                super()._load_rng_state(checkpoint)
                return
            with tempfile.TemporaryDirectory() as renamed:
                shutil.copyfile(Path(checkpoint) / source, Path(renamed) / own)
                super()._load_rng_state(renamed)

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


def skip_filling_uninitialized_memory() -> None:
    """Keep torch's deterministic algorithms, without their filling of every new tensor before its first write.

    ``torch.use_deterministic_algorithms(True)`` (``--full_determinism``) also makes torch fill each new tensor with
    NaN (``torch.utils.deterministic.fill_uninitialized_memory``), a guard against kernels that read memory they never
    wrote. No kernel of a training step does: the weights after the same steps are bit-identical either way, and the
    fills cost a measurable share of the default step (benchmarks/records/2026-12-01_step_profile_xeon-avx512.md).
    """
    torch.utils.deterministic.fill_uninitialized_memory = False


@contextmanager
def failure_names_file(checkpoint: str | None, name: str):
    """Loading Trainer state from ``checkpoint`` fails as one `CheckpointFileError` naming the file."""
    try:
        yield
    except Exception as error:
        raise CheckpointFileError(
            f"{Path(checkpoint) / name} cannot be loaded into this run (corrupt, truncated, or saved by another "
            f"optimizer?): {first_line(error)}"
        ) from error


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def save_failure(name: str, folder: Path, error: BaseException) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    full = run_folder.write_failure_cause(error)
    return f"saving {name} in {folder} failed{full}: {reason}; nothing partial was published"


def write_batch_size(args: TrainingArguments, path: Path) -> None:
    run_folder.write_new_file(path, (json.dumps(batch_size(args)) + "\n").encode())


def batch_size(args: TrainingArguments) -> dict[str, int]:
    per_device, accumulation, processes = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size
    return {
        "global": per_device * accumulation * processes,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "processes": processes,
    }


def check_resumable(model, checkpoint: str, training_args: TrainingArguments) -> None:
    """The checkpoint must hold exactly the model's tensors, all finite; a changed global batch is allowed but
    announced."""
    shard_files = checkpoint_shard_files(Path(checkpoint))
    verify_checkpoint_files(model, shard_files)
    check_finite_files(shard_files, f"--resume_from_checkpoint {checkpoint}")
    saved = Path(checkpoint) / BATCH_FILE
    if not saved.is_file():
        return
    try:
        old = json.loads(saved.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointFileError(f"{saved} cannot be read: {first_line(error)}") from None
    new = batch_size(training_args)
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


def finished_step(checkpoint: str | None, training_args: TrainingArguments) -> int | None:
    """The checkpoint's step when it already reached the run's end (--max_steps, else the step count it recorded)."""
    if checkpoint is None:
        return None
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    last_step = training_args.max_steps if training_args.max_steps > 0 else state["max_steps"]
    return state["global_step"] if state["global_step"] >= last_step else None
