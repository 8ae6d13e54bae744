"""A checkpoint resumes under another process count, as docs/scaling-out.md promises: Trainer's per-rank RNG files
(``rng_state_{rank}.pth``) and a single process's ``rng_state.pth`` are mapped onto the new ranks, and with the same
global batch (2 processes x 2 sequences = 1 process x 2 sequences x 2 accumulated micro-batches) the resumed run
ends bitwise where the uninterrupted one does. Unequal saved states are restored as well as they can be, with one
line saying why the resume cannot be exact."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kimi_k3.job.resume_manifest import check_trainer_files
from tests.conftest import HANG_CEILING_S, run_processes
from tests.job.test_train import run_main, tiny_args, write_corpus
from tests.parallel.test_distributed import DDP_CONFIG, free_port
from transformers import TrainingArguments

pytestmark = pytest.mark.distributed

RESUMED = "checkpoint-4"
COMMON = ("--eval_strategy", "no", "--per_device_train_batch_size", "2", "--no_fused_situ", "--use_cpu", "True")
TWO_PROCESSES = COMMON
ONE_PROCESS = (*COMMON, "--gradient_accumulation_steps", "2")


def launch_two(args: list[str]) -> str:
    return run_processes([
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG), "--num_processes", "2",
        "--main_process_port", str(free_port()), "-m", "kimi_k3.job", *args,
    ], HANG_CEILING_S)  # fmt: skip


def resumable_copy(run: Path, folder: Path) -> Path:
    """A new output folder holding only ``run``'s mid-run checkpoint, for ``--resume_from_checkpoint True``."""
    shutil.copytree(run / RESUMED, folder / RESUMED)
    return folder


def assert_same_weights(run: Path, reference: Path) -> None:
    actual, expected = load_file(run / "model" / "model.safetensors"), load_file(reference / "model" / "model.safetensors")
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_two_process_checkpoint_resumes_in_one_process_bitwise_the_uninterrupted_run(tmp_path, corpus):
    launch_two(tiny_args(tmp_path / "two", corpus, *TWO_PROCESSES))
    assert {path.name for path in (tmp_path / "two" / RESUMED).glob("rng_state*")} == {"rng_state_0.pth",
                                                                                      "rng_state_1.pth"}
    resumed = resumable_copy(tmp_path / "two", tmp_path / "one")
    status, _ = run_main(tiny_args(resumed, corpus, *ONE_PROCESS, "--resume_from_checkpoint", "True"))
    assert status == 0
    assert_same_weights(resumed, tmp_path / "two")


def test_one_process_checkpoint_resumes_in_two_processes_bitwise_the_uninterrupted_run(tmp_path, corpus):
    status, _ = run_main(tiny_args(tmp_path / "one", corpus, *ONE_PROCESS))
    assert status == 0
    resumed = resumable_copy(tmp_path / "one", tmp_path / "two")
    output = launch_two(tiny_args(resumed, corpus, *TWO_PROCESSES, "--resume_from_checkpoint", "True"))
    assert "cannot be exact" not in output
    assert_same_weights(resumed, tmp_path / "one")


def test_unequal_saved_random_states_resume_with_one_line_saying_why_not_exactly(tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(
        '{"global_step": 4, "max_steps": 8, "log_history": [], "stateful_callbacks": {"TrainerControl": {}}}'
    )
    for name in ("optimizer.pt", "scheduler.pt"):
        torch.save({}, checkpoint / name)
    for rank in range(2):
        torch.save({"python": (rank,), "cpu": torch.full((4,), rank)}, checkpoint / f"rng_state_{rank}.pth")
    check_trainer_files(str(checkpoint), TrainingArguments(tmp_path / "out"), reinitialize_missing=False)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cannot be exact: the 2 saved processes' random states differ" in lines[0]
    torch.save({"python": (0,), "cpu": torch.zeros(4)}, checkpoint / "rng_state_1.pth")
    check_trainer_files(str(checkpoint), TrainingArguments(tmp_path / "out"), reinitialize_missing=False)
    assert capsys.readouterr().err == ""
