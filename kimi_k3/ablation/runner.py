"""Running the matrix: one training job per (row, seed), each in its own folder, one after another.

``OUTPUT/runs/<row>/seed-<s>/`` is the job's ``--output_dir``; beside it ``seed-<s>.log`` holds what the job printed
(appended across resumes) and ``seed-<s>.json`` the run's measurements, written last, atomically: its presence is
what makes a run finished. A rerun of the same matrix skips finished runs, resumes a run that has a checkpoint (the
job's own ``--resume_from_checkpoint True``, bit for bit) and starts the others; a run folder that recorded other
settings is refused before anything starts. Every run shares one tokenizer, trained once by the job's own BPE
trainer into ``OUTPUT/tokenizer``.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

import kimi_k3
from kimi_k3.ablation.measure import measure_run
from kimi_k3.ablation.report import run_machine
from kimi_k3.ablation.rows import AblationError, Preset, Row, check_applies, select_rows
from kimi_k3.checkpoint import run_folder
from kimi_k3.job.arguments import parse_args
from kimi_k3.text.corpus import load_corpus, tokenizer_documents
from kimi_k3.text.tokenizer import train_bpe_tokenizer

TOKENIZER_DIR = "tokenizer"
RUNS_DIR = "runs"


@dataclass(frozen=True)
class Matrix:
    """What to run: the preset with the command line's selections applied."""

    preset: Preset
    rows: list[Row]
    seeds: tuple[int, ...]
    max_steps: int
    output_dir: Path
    model: dict
    data_files: list[str] | None
    job_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlannedRun:
    row: Row
    seed: int
    folder: Path
    argv: tuple[str, ...]

    @property
    def result_file(self) -> Path:
        return self.folder.with_name(f"{self.folder.name}.json")

    @property
    def log_file(self) -> Path:
        return self.folder.with_name(f"{self.folder.name}.log")

    def finished(self) -> dict | None:
        """The measurements of a finished run with these settings, None when it has not finished; an `AblationError`
        when the folder recorded a run with other settings."""
        if not self.result_file.is_file():
            return None
        result = json.loads(self.result_file.read_text())
        if result.get("argv") != list(self.argv):
            raise AblationError(
                f"{self.result_file} records a run with other settings ({' '.join(result.get('argv', []))}); choose "
                "another --output_dir, or remove that run to train it again"
            )
        return result


def plan(matrix: Matrix) -> list[PlannedRun]:
    """Every (row, seed) of the matrix with its job arguments; refuses a row that cannot apply to the baseline."""
    runs = []
    for row in matrix.rows:
        overrides = check_applies(row, matrix.model)
        for seed in matrix.seeds:
            folder = matrix.output_dir / RUNS_DIR / row.name / f"seed-{seed}"
            argv = tuple(job_arguments(matrix, row, overrides, seed, folder))
            check_job_arguments(row, argv)
            runs.append(PlannedRun(row, seed, folder, argv))
    return runs


def job_arguments(matrix: Matrix, row: Row, overrides: dict, seed: int, folder: Path) -> list[str]:
    preset = matrix.preset
    data = ["--data_files", *matrix.data_files] if matrix.data_files else []
    limit = ["--max_eval_samples", str(preset.max_eval_samples)] if preset.max_eval_samples else []
    return [
        "--output_dir", str(folder), "--seed", str(seed), "--max_steps", str(matrix.max_steps),
        "--config_overrides", json.dumps({**matrix.model, **overrides}, sort_keys=True),
        "--tokenizer_name_or_path", str(matrix.output_dir / TOKENIZER_DIR), "--block_size", str(preset.block_size),
        *limit, *data, "--disable_tqdm", "True", "--report_to", "none", *preset.flags, *matrix.job_args, *row.flags,
    ]  # fmt: skip


def check_job_arguments(row: Row, argv: tuple[str, ...]) -> None:
    """The job's own parser on a run's arguments, so that a bad option stops the matrix before its first run."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            parse_args(list(argv))
    except SystemExit:
        lines = printed.getvalue().strip().splitlines()
        raise AblationError(f"row {row.name!r}: kimi-k3-train refuses its options: "
                            f"{lines[-1] if lines else ' '.join(argv)}") from None
    except ValueError as error:
        raise AblationError(f"row {row.name!r}: kimi-k3-train refuses its options: {error}") from None


def prepare_tokenizer(matrix: Matrix) -> None:
    """The job's byte-level BPE, trained once on the training split and shared by every run."""
    target = matrix.output_dir / TOKENIZER_DIR
    if target.is_dir():
        return
    splits, _ = load_corpus(matrix.data_files, "text", 5.0)
    tokenizer = train_bpe_tokenizer(tokenizer_documents(splits["train"]), matrix.preset.tokenizer_vocab_size)
    staging = target.with_name(run_folder.staging_name(target.name, run_folder.new_tag()))
    tokenizer.save_pretrained(staging)
    os.replace(staging, target)


class Progress:
    """One line per run: how many are done, and the time left estimated from the runs trained in this invocation."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.durations = total, done, []

    def starting(self, run: PlannedRun, resuming_from: str | None) -> None:
        how = f"resuming from {Path(resuming_from).name}" if resuming_from else "training"
        print(f"kimi-k3-ablate: [{self.done + 1}/{self.total}] {run.row.name} seed {run.seed}: {how}", flush=True)

    def finished(self, run: PlannedRun, seconds: float, summary: str) -> None:
        self.done += 1
        self.durations.append(seconds)
        left = self.total - self.done
        estimate = sum(self.durations) / len(self.durations) * left
        rest = f"{left} left, about {_duration(estimate)} to go" if left else "all done"
        print(f"kimi-k3-ablate: [{self.done}/{self.total}] {run.row.name} seed {run.seed} done in {seconds:.0f} s "
              f"({summary}); {rest}", flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def run_matrix(matrix: Matrix, runs: list[PlannedRun]) -> list[str]:
    """Train and measure every unfinished run; returns one line per failed run (the others go on)."""
    pending = [run for run in runs if run.finished() is None]
    if len(pending) < len(runs):
        print(f"kimi-k3-ablate: {len(runs) - len(pending)} of {len(runs)} runs already finished, skipped", flush=True)
    if pending:
        prepare_tokenizer(matrix)
    progress, failures = Progress(len(runs), len(runs) - len(pending)), []
    for run in pending:
        start = time.perf_counter()
        failure = train(run, progress)
        if failure is None:
            metrics = measure_run(run.folder, matrix.data_files, matrix.preset.block_size,
                                  matrix.preset.max_eval_samples)
            write_result(run, metrics)
            progress.finished(run, time.perf_counter() - start, f"eval loss {metrics['eval_loss']:.4f}")
        else:
            failures.append(failure)
            print(f"kimi-k3-ablate: {failure}", file=sys.stderr, flush=True)
    return failures


def train(run: PlannedRun, progress: Progress) -> str | None:
    """Run (or resume) the job for ``run``; None on success, else a line naming the run, its log and its error."""
    checkpoint = get_last_checkpoint(str(run.folder)) if run.folder.is_dir() else None
    progress.starting(run, checkpoint)
    argv = [*run.argv, *(["--resume_from_checkpoint", "True"] if checkpoint else [])]
    run.folder.parent.mkdir(parents=True, exist_ok=True)
    with run.log_file.open("a") as log:
        log.write(f"$ kimi-k3-train {' '.join(argv)}\n")
        log.flush()
        status = subprocess.run([sys.executable, "-m", "kimi_k3.job.main", *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=job_environment(), check=False).returncode
    if status == 0:
        return None
    lines = run.log_file.read_text().strip().splitlines()
    return f"{run.row.name} seed {run.seed} failed (status {status}, log {run.log_file}): {lines[-1] if lines else ''}"


def job_environment() -> dict[str, str]:
    """The environment with this code's own folder first on PYTHONPATH, so the job runs the code the runner runs (a
    checkout run without an install, or a checkout beside an installed copy)."""
    here = str(Path(kimi_k3.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}


def write_result(run: PlannedRun, metrics: dict) -> None:
    record = {"row": run.row.name, "seed": run.seed, "argv": list(run.argv), "metrics": metrics,
              "machine": run_machine(), "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    staged = run.result_file.with_name(run_folder.staging_name(run.result_file.name, run_folder.new_tag()))
    staged.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(staged, run.result_file)


def select(preset: Preset, rows: list[str] | None, seeds: list[int] | None, max_steps: int | None) -> tuple:
    """The rows, seeds and steps of the command line, defaulting to the preset's; checked."""
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0):
        raise AblationError(f"--seeds must be distinct integers >= 0, got {seeds}")
    if max_steps is not None and max_steps < 1:
        raise AblationError(f"--max_steps must be >= 1, got {max_steps}")
    return select_rows(rows, preset), tuple(seeds or preset.seeds), max_steps or preset.max_steps
