"""Nothing silent: a diverged run fails and publishes nothing, a mistyped path runs no stranger's code, the job writes
through no planted link, a resume restores everything or says why not, and sizes are bounded before allocation."""

import errno
import hashlib
import importlib.util
import json
import math
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast, TrainerCallback

from kimi_k3.checkpoint import run_folder
from kimi_k3.job import main as train
from kimi_k3.job.run_settings import check_unchanged
from kimi_k3.job.trainer import save_failure
from kimi_k3.publishing import hub
from kimi_k3.publishing.model_card import TrainingSummary, render_model_card
from configuration_kimi_k3 import KimiK3Config
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import HANG_CEILING_S, TINY_CONFIG
from tests.job.test_train import REPO, TINY_MODEL, run_main, tiny_args, trained, weights  # noqa: F401 (fixture)

RESUME = ["--resume_from_checkpoint", "True", "--max_steps", "12"]


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def all_finite(folder: Path) -> bool:
    return all(torch.isfinite(tensor).all() for tensor in weights(folder).values())


def with_nan(folder: Path, name: str) -> None:
    tensors = weights(folder)
    tensors[name].view(-1)[0] = math.nan
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------------------------------
# A diverged run is a failure, and nothing non-finite is saved or published
# ---------------------------------------------------------------------------------------------------------------------
def test_diverging_run_exits_1_naming_the_step_and_saves_no_model(trained, tmp_path, capsys):
    run = tmp_path / "run"
    status, _ = run_main(tiny_args(run, trained[1], "--learning_rate", "100"))
    assert status == 1
    assert last_error(capsys).startswith("kimi-k3-train: error: training diverged: the gradients are not finite at step")
    assert not (run / "model").exists()
    assert all(all_finite(checkpoint) for checkpoint in run.glob("checkpoint-*"))


class PoisonWeightsAfterStep(TrainerCallback):
    """Gradients stay finite up to the step, but the weights it leaves hold a NaN: only the save guard sees it."""

    def __init__(self, step: int):
        self.step = step

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                model.lm_head.weight[0, 0] = math.nan


def test_non_finite_weights_are_never_written_to_a_checkpoint(trained, tmp_path, monkeypatch, capsys):
    build = train.optimizer_and_callbacks

    def poisoned(*args, **kwargs):
        optimizer, callbacks = build(*args, **kwargs)
        return optimizer, [*callbacks, PoisonWeightsAfterStep(4)]

    monkeypatch.setattr(train, "optimizer_and_callbacks", poisoned)
    run = tmp_path / "run"
    assert run_main(tiny_args(run, trained[1]))[0] == 1
    assert last_error(capsys) == (
        "kimi-k3-train: error: training diverged: lm_head.weight holds 1 non-finite value(s); checkpoint-4 was not "
        "saved; start again with a lower --learning_rate (or more --warmup_steps), or train on from the last "
        "checkpoint's weights with --model_name_or_path CHECKPOINT and a lower rate"
    )
    assert not run.exists() or not list(run.glob("checkpoint-*")) and not (run / "model").exists()


@pytest.mark.parametrize("rate", ["nan", "inf", "-1"])
def test_non_finite_or_negative_learning_rate_is_refused_before_training(trained, tmp_path, capsys, rate):
    assert train.main(tiny_args(tmp_path / "out", trained[1], "--learning_rate", rate)) == 2
    assert last_error(capsys) == f"kimi-k3-train: error: --learning_rate must be a finite number >= 0, got {float(rate)}"
    assert not (tmp_path / "out").exists()


def test_resuming_a_checkpoint_that_holds_nan_is_refused_naming_the_tensor(trained, tmp_path, capsys):
    run = shutil.copytree(trained[0], tmp_path / "run")
    with_nan(run / "checkpoint-8", "lm_head.weight")
    before = sorted(path.name for path in run.iterdir())
    assert train.main(tiny_args(run, trained[1], *RESUME)) == 2
    message = last_error(capsys)
    assert message.startswith(f"kimi-k3-train: error: --resume_from_checkpoint {run / 'checkpoint-8'}: tensor lm_head.weight")
    assert "holds 1 non-finite value(s)" in message
    assert sorted(path.name for path in run.iterdir()) == before


def test_fine_tuning_a_base_model_that_holds_nan_is_refused(trained, tmp_path, capsys):
    base = shutil.copytree(trained[0] / "model", tmp_path / "base")
    with_nan(base, "model.embed_tokens.weight")
    assert train.main(tiny_args(tmp_path / "out", trained[1], "--model_name_or_path", str(base))) == 2
    assert last_error(capsys).startswith(
        f"kimi-k3-train: error: --model_name_or_path {base}: its tensor model.embed_tokens.weight holds 1 non-finite"
    )
    assert not (tmp_path / "out").exists()


def test_a_folder_with_non_finite_weights_is_never_published(trained, tmp_path):
    folder = shutil.copytree(trained[0] / "model", tmp_path / "model")
    hub.check_publishable(folder)
    with_nan(folder, "lm_head.weight")
    with pytest.raises(hub.HubError, match=r"tensor lm_head\.weight in .* holds 1 non-finite value\(s\)"):
        hub.check_publishable(folder)


def test_a_non_finite_final_evaluation_fails_the_run():
    from kimi_k3.job.health import TrainingDiverged, check_finite_metric

    check_finite_metric({"eval_loss": 4.2}, "eval_loss")
    with pytest.raises(TrainingDiverged, match="the final eval_loss is nan; the final model was not saved"):
        check_finite_metric({"eval_loss": math.nan}, "eval_loss")


def test_card_says_not_logged_for_a_loss_it_did_not_measure():
    model = KimiK3ForCausalLM(KimiK3ForCausalLM.config_class(**TINY_CONFIG))
    summary = TrainingSummary(
        data="d", train_tokens=1, eval_tokens=1, block_size=8, steps=1, global_batch_size=1, optimizer="AdamW",
        learning_rate=1e-3, router_balancing="none", first_loss=math.nan, last_loss=math.nan, eval_loss=3.0,
        eval_perplexity=20.1, wall_time_s=1.0,
    )  # fmt: skip
    card = str(render_model_card(model, "tiny", summary))
    assert "| first training loss | not logged |" in card and "| last training loss | not logged |" in card
    assert "| final eval loss | 3.000 |" in card


# ---------------------------------------------------------------------------------------------------------------------
# scripts/generate.py: no hub fallback for a path, remote code only on request, lengths checked first
# ---------------------------------------------------------------------------------------------------------------------
def generate_script():
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["outputs/kimi-k3-smal", "./kimi-k3-small", "a/b/c", "~/no-such-kimi-folder"])
def test_generate_refuses_a_missing_path_without_asking_the_hub(tmp_path, monkeypatch, capsys, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    script = generate_script()
    monkeypatch.setattr(script, "load", lambda *args: pytest.fail("the hub was asked"))
    with pytest.raises(SystemExit) as exit_info:
        script.main([name, "--trust_remote_code"])
    assert exit_info.value.code == 2
    assert last_error(capsys).endswith(f"error: no such folder: {name} (a local path is never looked up on the hub)")


@pytest.mark.parametrize("name", ["outptus/kimi-k3-small", "kimi-k3-smal"])
def test_generate_asks_the_hub_only_with_from_hub_so_a_mistyped_path_never_runs_a_repos_code(
    tmp_path, monkeypatch, capsys, name
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "kimi-k3-small").mkdir(parents=True)
    script = generate_script()
    monkeypatch.setattr(script, "load", lambda *args: pytest.fail("the hub was asked"))
    with pytest.raises(SystemExit) as exit_info:
        script.main([name, "--trust_remote_code"])
    assert exit_info.value.code == 2
    assert last_error(capsys).endswith(
        f"error: no such folder: {name}; to load the hub repository of that name, pass --from_hub"
    )
    assert script.missing_local_path(name, from_hub=True) is None


def test_generate_refuses_a_fifo_tokenizer_or_a_linked_weight_in_one_line_before_reading(trained, tmp_path, capsys):
    script = generate_script()
    folder = tmp_path / "model"
    shutil.copytree(trained[0] / "model", folder)
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")
    with pytest.raises(SystemExit):
        script.main([str(folder), "--trust_remote_code"])
    assert last_error(capsys).endswith(f"error: {folder / 'tokenizer.json'} is not a regular file (a FIFO, device, "
                                       "socket or folder); refusing to read it.")
    (folder / "tokenizer.json").unlink()
    shutil.copy(trained[0] / "model" / "tokenizer.json", folder / "tokenizer.json")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(trained[0] / "model" / "model.safetensors")
    with pytest.raises(SystemExit):
        script.main([str(folder), "--trust_remote_code"])
    assert f"{folder / 'model.safetensors'} resolves to" in last_error(capsys)


def test_generate_names_the_folder_of_a_malformed_tokenizer(trained, tmp_path, capsys):
    script = generate_script()
    folder = shutil.copytree(trained[0] / "model", tmp_path / "model")
    (folder / "tokenizer.json").write_text((trained[0] / "model" / "tokenizer.json").read_text()[:3000])
    with pytest.raises(SystemExit):
        script.main([str(folder), "--trust_remote_code"])
    assert f"error: {folder}: its tokenizer files cannot be read (malformed tokenizer.json?): " in last_error(capsys)


def test_generate_runs_the_folders_code_only_with_trust_remote_code(trained, capsys):
    script = generate_script()
    with pytest.raises(SystemExit) as exit_info:
        script.main([str(trained[0] / "model"), "--max_new_tokens", "2"])
    assert exit_info.value.code == 2
    assert last_error(capsys).endswith(
        f"error: {trained[0] / 'model'} ships its own model code: read it, then pass --trust_remote_code to run it"
    )


def test_generate_checks_max_new_tokens_against_the_position_limit_before_generating(trained, monkeypatch, capsys):
    script = generate_script()
    monkeypatch.setattr(script, "continuation", lambda *args, **kwargs: pytest.fail("generation started"))
    with pytest.raises(SystemExit):
        script.main([str(trained[0] / "model"), "--trust_remote_code", "--prompt", "The", "--max_new_tokens", "600"])
    message = last_error(capsys)
    assert "--max_new_tokens 600 plus the prompt's" in message and "max_position_embeddings (512)" in message


@pytest.mark.parametrize("flag", ["--model_name_or_path", "--tokenizer_name_or_path"])
def test_job_refuses_a_missing_model_or_tokenizer_path_without_asking_the_hub(trained, tmp_path, monkeypatch, capsys,
                                                                              flag):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    assert train.main(tiny_args(tmp_path / "out", trained[1], flag, "outputs/kimi-k3-smal")) == 2
    assert last_error(capsys) == (
        f"kimi-k3-train: error: {flag} outputs/kimi-k3-smal: no such folder (a local path is never looked up on the hub)"
    )


@pytest.mark.parametrize("inside", ["model/mine", "model", "checkpoint-4/mine", "running/checkpoint-8/mine"])
def test_output_dir_inside_another_jobs_model_or_checkpoint_is_refused_before_anything_is_written(
    trained, tmp_path, capsys, inside
):
    jobs = tmp_path / "jobs"
    shutil.copytree(trained[0], jobs, ignore=shutil.ignore_patterns(run_folder.LOCK_NAME))
    (jobs / "running").mkdir()
    (jobs / "running" / run_folder.LOCK_NAME).write_text("{}")  # a job that has not saved yet
    before = {path: path.stat().st_mtime_ns for path in jobs.rglob("*")}  # a probe file would touch its folder
    assert train.main(tiny_args(jobs / inside, trained[1])) == 2
    enclosing = (jobs / inside).parent if inside.endswith("mine") else jobs / inside
    assert last_error(capsys) == (
        f"kimi-k3-train: error: --output_dir {jobs / inside} lies inside {enclosing}, which the job writing "
        f"{enclosing.parent} replaces or deletes on its next save; choose a folder outside it"
    )
    assert {path: path.stat().st_mtime_ns for path in jobs.rglob("*")} == before


def test_fine_tuning_from_a_folder_without_weights_or_tokenizer_is_one_line_before_anything_is_written(
    trained, tmp_path, capsys
):
    folder = shutil.copytree(trained[0] / "model", tmp_path / "base")
    (folder / "model.safetensors").unlink()
    assert train.main(tiny_args(tmp_path / "out", trained[1], "--model_name_or_path", str(folder))) == 2
    assert last_error(capsys).startswith(f"kimi-k3-train: error: --model_name_or_path {folder}: no weights")
    shutil.copy(trained[0] / "model" / "model.safetensors", folder)
    (folder / "tokenizer.json").unlink()
    assert train.main(tiny_args(tmp_path / "out", trained[1], "--model_name_or_path", str(folder))) == 2
    assert last_error(capsys) == (f"kimi-k3-train: error: --model_name_or_path {folder}: no tokenizer.json; pass "
                                  "--tokenizer_name_or_path with a folder that has one")
    with open(folder / "tokenizer.json", "w") as huge:
        huge.truncate(1_200_000_000)  # sparse: read whole, it would cost 1.2 GB
    assert train.main(tiny_args(tmp_path / "out", trained[1], "--model_name_or_path", str(folder))) == 2
    assert last_error(capsys) == (
        f"kimi-k3-train: error: --model_name_or_path: {folder / 'tokenizer.json'} holds 1,200,000,000 bytes, more "
        "than the 100,000,000 read whole at most."
    )
    assert not (tmp_path / "out").exists()


def test_a_malformed_tokenizer_is_one_line_naming_its_folder(trained, tmp_path, capsys):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{bad")
    assert train.main(tiny_args(tmp_path / "out", trained[1], "--tokenizer_name_or_path", str(folder))) == 2
    assert last_error(capsys).startswith(
        f"kimi-k3-train: error: {folder}: its tokenizer files cannot be read (malformed tokenizer.json?): "
    )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# No file is written through a planted link
# ---------------------------------------------------------------------------------------------------------------------
def test_planted_lock_symlink_is_refused_and_its_target_untouched(trained, tmp_path, capsys):
    victim = tmp_path / "precious.txt"
    victim.write_text("do not overwrite")
    out = tmp_path / "out"
    out.mkdir()
    (out / run_folder.LOCK_NAME).symlink_to(victim)
    assert train.main(tiny_args(out, trained[1])) == 2
    assert last_error(capsys) == (
        f"kimi-k3-train: error: --output_dir {out}: {run_folder.LOCK_NAME} is a symbolic link (to {victim}); the job "
        "never writes through a link: remove it"
    )
    assert victim.read_text() == "do not overwrite"


def test_job_files_are_written_only_as_new_files_never_through_a_link(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep")
    (tmp_path / "expert_load.png").symlink_to(victim)
    with pytest.raises(run_folder.FolderNotWritableError, match="already exists"):
        run_folder.write_new_file(tmp_path / "expert_load.png", b"png")
    assert victim.read_text() == "keep"


def test_lock_release_in_a_folder_made_read_only_mid_run_warns_in_one_line(tmp_path, monkeypatch, capsys):
    lock = run_folder.OutputFolderLock(tmp_path / "out").acquire()

    def read_only(path, missing_ok=False):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(type(lock.path), "unlink", read_only)
    lock.release()
    assert capsys.readouterr().err == (
        f"kimi-k3-train: warning: could not remove {lock.path} (Permission denied); the next job takes it over\n"
    )


def test_a_file_size_limit_is_not_reported_as_a_full_disk(tmp_path):
    short_write = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 686016 vs 685908")
    assert "(the file size limit, ulimit -f, was reached)" in save_failure("model", tmp_path, OSError(errno.EFBIG, "x"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**40, hard))
    try:
        limited = save_failure("checkpoint-4", tmp_path, short_write)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert limited.startswith("saving checkpoint-4 in ") and "(the file size limit, ulimit -f, was reached)" in limited
    assert "(the disk is full)" in save_failure("checkpoint-4", tmp_path, short_write)


# ---------------------------------------------------------------------------------------------------------------------
# Resume restores everything, or refuses naming what it lacks or what changed
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("missing", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
def test_resume_refuses_a_checkpoint_without_its_trainer_state_unless_told(trained, tmp_path, capsys, missing):
    run = shutil.copytree(trained[0], tmp_path / "run")
    (run / "checkpoint-8" / missing).unlink()
    assert train.main(tiny_args(run, trained[1], *RESUME)) == 2
    assert last_error(capsys) == (
        f"kimi-k3-train: error: --resume_from_checkpoint {run / 'checkpoint-8'} has no {missing}: resuming would "
        "restart the optimizer moments, the learning-rate schedule or the random state, so the run would not continue "
        "the original one; resume from a complete checkpoint, or pass --reinitialize_missing_trainer_state to start "
        "them afresh"
    )
    assert run_main(tiny_args(run, trained[1], *RESUME, "--reinitialize_missing_trainer_state"))[0] == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert any(f"has no {missing}; starting the" in line for line in warnings)


CORRUPT_FILES = {
    "optimizer.pt": lambda path: path.write_bytes(b"not a zip"),
    "scheduler.pt": lambda path: path.write_bytes(path.read_bytes()[:20]),
    "rng_state.pth": lambda path: path.write_bytes(b"\x80\x02garbage"),
    "trainer_state.json": lambda path: path.write_text("{truncated"),
    "batch_size.json": lambda path: path.write_text("{truncated"),
    "run_settings.json": lambda path: path.write_bytes(b"\xff\xfe"),
}


@pytest.mark.parametrize("name", sorted(CORRUPT_FILES))
def test_corrupt_trainer_file_is_refused_in_one_line_naming_it(trained, tmp_path, capsys, name):
    run = shutil.copytree(trained[0], tmp_path / "run")
    CORRUPT_FILES[name](run / "checkpoint-8" / name)
    assert train.main(tiny_args(run, trained[1], *RESUME)) == 2
    message = last_error(capsys)
    assert message.startswith(f"kimi-k3-train: error: {run / 'checkpoint-8' / name} cannot be")
    assert "Traceback" not in capsys.readouterr().err


def test_unreadable_checkpoint_config_is_refused_in_one_line_naming_it(trained, tmp_path, capsys):
    run = shutil.copytree(trained[0], tmp_path / "run")
    (run / "checkpoint-8" / "config.json").write_text("{truncated")
    assert train.main(tiny_args(run, trained[1], *RESUME)) == 2
    assert last_error(capsys) == (
        f"kimi-k3-train: error: --resume_from_checkpoint {run / 'checkpoint-8'}: It looks like the config file at "
        f"'{run / 'checkpoint-8' / 'config.json'}' is not a valid JSON file."
    )


def test_trainer_state_without_stateful_callbacks_is_refused_naming_the_field(trained, tmp_path, capsys):
    run = shutil.copytree(trained[0], tmp_path / "run")
    state_path = run / "checkpoint-8" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    del state["stateful_callbacks"]
    state_path.write_text(json.dumps(state))
    assert train.main(tiny_args(run, trained[1], *RESUME)) == 2
    assert last_error(capsys) == (
        f"kimi-k3-train: error: {state_path}: field 'stateful_callbacks' must be a JSON dict, got None; it is not a "
        "checkpoint written by transformers' Trainer"
    )


def test_resume_with_changed_settings_lists_every_change_in_one_refusal(trained, tmp_path, capsys):
    run = shutil.copytree(trained[0], tmp_path / "run")
    before = sorted(path.name for path in run.iterdir())
    changed = ["--learning_rate", "0.05", "--seed", "3", "--config_overrides",
               json.dumps({**TINY_MODEL, "routed_scaling_factor": 2.0})]  # fmt: skip
    assert train.main(tiny_args(run, trained[1], *RESUME) + changed) == 2
    message = last_error(capsys)
    assert "--learning_rate 0.05 (the run used 0.01)" in message and "--seed 3 (the run used 0)" in message
    assert "config field routed_scaling_factor 2.0 (the run used" in message
    assert message.endswith(f"start a new run from its weights with --model_name_or_path {run / 'checkpoint-8'}")
    assert sorted(path.name for path in run.iterdir()) == before


def test_the_refusals_way_out_starts_a_new_run_from_the_checkpoints_weights(trained, tmp_path):
    """What the refusal proposes: a new run with the changed settings, from the weights only."""
    checkpoint = trained[0] / "checkpoint-8"
    extra = ["--model_name_or_path", str(checkpoint), "--learning_rate", "0.005", "--max_steps", "1"]
    status, printed = run_main(tiny_args(tmp_path / "run", trained[1], *extra))
    assert status == 0 and "1 steps" in printed
    assert json.loads((tmp_path / "run" / "checkpoint-1" / "run_settings.json").read_text())["learning_rate"] == 0.005


def test_resume_with_a_changed_data_file_is_refused(trained, tmp_path, capsys):
    run = shutil.copytree(trained[0], tmp_path / "run")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(trained[1].read_text() + "\nOne more document about the with statement.")
    assert train.main(tiny_args(run, corpus, *RESUME)) == 2
    assert "--data_files {" in last_error(capsys)


def test_checkpoints_record_the_run_settings_that_a_resume_compares(trained):
    settings = json.loads((trained[0] / "checkpoint-8" / "run_settings.json").read_text())
    assert settings["learning_rate"] == 0.01 and settings["block_size"] == 32 and settings["seed"] == 0
    assert settings["data_files"] == {str(trained[1]): "sha256:" + hashlib.sha256(trained[1].read_bytes()).hexdigest()}
    assert settings["bf16"] is False and settings["label_smoothing_factor"] == 0.0
    assert settings["config"]["num_experts"] == TINY_MODEL["num_experts"]


def test_resume_refuses_a_same_size_data_edit_added_precision_and_loss_options_and_an_edited_config(
    trained, tmp_path, capsys
):
    run = shutil.copytree(trained[0], tmp_path / "run")
    corpus = shutil.copy(trained[1], tmp_path / "corpus.txt")
    settings_path = run / "checkpoint-8" / "run_settings.json"
    settings = json.loads(settings_path.read_text())
    settings_path.write_text(json.dumps({**settings, "data_files": {str(corpus): settings["data_files"][str(trained[1])]}}))
    text = corpus.read_text()
    corpus.write_text(text[:-1] + ("x" if text[-1] != "x" else "y"))  # same size, other content
    config_path = run / "checkpoint-8" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "routed_scaling_factor": 3.5}))
    before = sorted(run.rglob("*"))
    changed = ["--bf16", "True", "--label_smoothing_factor", "0.1", "--use_cpu", "True"]
    assert train.main(tiny_args(run, corpus, *RESUME, *changed)) == 2
    message = last_error(capsys)
    assert f'--data_files {{"{corpus}": "sha256:' in message
    assert "--bf16 true (the run used false)" in message and "--label_smoothing_factor 0.1 (the run used 0.0)" in message
    assert "config field routed_scaling_factor 3.5 (the run used" in message
    assert sorted(run.rglob("*")) == before


def test_checkpoints_that_recorded_data_sizes_and_no_config_still_resume(trained, tmp_path):
    checkpoint = shutil.copytree(trained[0] / "checkpoint-8", tmp_path / "checkpoint-8")
    current = json.loads((checkpoint / "run_settings.json").read_text())
    older = {**current, "data_files": {str(trained[1]): trained[1].stat().st_size}}
    del older["config"]
    (checkpoint / "run_settings.json").write_text(json.dumps(older))
    check_unchanged(str(checkpoint), current, KimiK3Config.from_pretrained(checkpoint))


def test_saved_tokenizers_carry_the_models_position_limit_so_truncation_fits_the_model(trained):
    for folder in (trained[0] / "model", trained[0] / "checkpoint-8"):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        assert tokenizer.model_max_length == TINY_MODEL.get("max_position_embeddings", 512)
        assert len(tokenizer("with " * 2000, truncation=True)["input_ids"]) == tokenizer.model_max_length


# ---------------------------------------------------------------------------------------------------------------------
# Sizes bounded before allocation
# ---------------------------------------------------------------------------------------------------------------------
LOAD_UNDER_6_GB = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, resource.RLIM_INFINITY))
from modeling_kimi_k3 import KimiK3ForCausalLM
try:
    KimiK3ForCausalLM.from_pretrained(sys.argv[1])
except ValueError as error:
    sys.exit(str(error))
"""


def test_config_whose_expert_names_cannot_match_the_checkpoint_is_refused_before_building_them(trained, tmp_path):
    folder = shutil.copytree(trained[0] / "model", tmp_path / "huge")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_experts": 10**9}))
    result = subprocess.run([sys.executable, "-c", LOAD_UNDER_6_GB, str(folder)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=HANG_CEILING_S)  # fmt: skip
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("Refusing the config: num_experts gives 24,000,000,234 per-expert checkpoint names where "
                              "the checkpoint holds ")
    assert message.endswith("tensors; check num_experts in config.json")


@pytest.mark.parametrize("field", ["num_experts", "vocab_size"])
def test_model_larger_than_memory_is_refused_naming_the_field_and_size(trained, tmp_path, capsys, field):
    physical_memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    overrides = {**TINY_MODEL, field: physical_memory // 16}  # the leading size of tensors wider than 4 floats
    assert train.main(tiny_args(tmp_path / "out", trained[1], "--config_overrides", json.dumps(overrides))) == 2
    message = last_error(capsys)
    assert message.startswith("kimi-k3-train: error: --config_overrides: the model needs about")
    assert message.endswith(f"grow with {field}")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Hub settings checked before training
# ---------------------------------------------------------------------------------------------------------------------
def test_invalid_hub_model_id_is_refused_before_training(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")
    assert train.main(tiny_args(tmp_path / "out", trained[1], "--hub_model_id", "me/kimi k3!")) == 2
    assert last_error(capsys) == (
        "kimi-k3-train: error: --hub_model_id 'me/kimi k3!' is not a hub repository id (NAME or OWNER/NAME of "
        "letters, digits, '-', '_' and '.', at most 96 characters, no '--' or '..'); pass a valid --hub_model_id"
    )
    assert not (tmp_path / "out").exists()
