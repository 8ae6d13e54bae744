"""The training job end to end at toy size: loss falls, folders reload in a fresh process, resume is bit-exact,
saving is atomic, and bad input stops the job before anything is written."""

import contextlib
import errno
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer, TrainerState

from kimi_k3.checkpoint import run_folder
from kimi_k3.job import arguments, final_save
from kimi_k3.job import main as train
from kimi_k3.job.allocator import allocator_description
from kimi_k3.job.trainer import KimiK3Trainer, SaveError
from kimi_k3.text import corpus as data
from kimi_k3.job.expert_load import PLOT_EXTRA, ExpertLoadRecorder, matplotlib_available, token_share
from kimi_k3.publishing.model_card import render_model_card
from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.policies.qk_clip import QKClip
from kimi_k3.policies.quantile_balancing import QuantileBalancing
from kimi_k3.text.tokenizer import load_tokenizer, train_bpe_tokenizer
from modeling_kimi_k3 import KimiK3ForCausalLM
from variants_kimi_k3 import KimiK3VariantForCausalLM
from tests.conftest import HANG_CEILING_S, TINY_CONFIG, tiny_config

REPO = Path(__file__).resolve().parents[2]
# The shared tiny model of the tests; the vocabulary size comes from the trained tokenizer.
TINY_MODEL = {key: value for key, value in TINY_CONFIG.items() if key != "vocab_size"} | {"num_shared_experts": 1}
PROMPT = "The with statement"
SAMPLING = ["--max_new_tokens", "12", "--do_sample", "--temperature", "1.0", "--top_k", "50", "--seed", "0"]
# Runs in `python -I` with the installed code blocked, so only the folder's own files can serve the Auto classes.
GENERATE_IN_FRESH_PROCESS = """
import runpy, sys
for name in ("modeling_kimi_k3", "configuration_kimi_k3", "kimi_k3"):
    sys.modules[name] = None
script = sys.argv.pop()
sys.argv = ["generate.py", *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
assert any(name.startswith("transformers_modules.") and name.endswith(".modeling_kimi_k3") for name in sys.modules)
"""


# What a toy run leaves in --output_dir: two checkpoints, the final model and, with matplotlib, the expert-load picture.
RUN_FOLDER = ["checkpoint-4", "checkpoint-8", *(["expert_load.png"] if matplotlib_available() else []), "model"]
# Runs in `python -I` with stdin closed: only transformers and the folder's own files, as for a user of the folder.
LOAD_TOKENIZER_IN_FRESH_PROCESS = """
import sys
from transformers import AutoTokenizer, PreTrainedTokenizerFast
folder, prompt = sys.argv[1:3]
for how in sys.argv[3:]:
    if how == "auto":
        tokenizer = AutoTokenizer.from_pretrained(folder)
    elif how == "auto, trusting the folder":
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    print(tokenizer(prompt)["input_ids"])
"""


def write_corpus(folder: Path) -> Path:
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(data.reference_topics()[:12]))
    return corpus


def tiny_args(output_dir: Path, corpus: Path | None, *extra: str) -> list[str]:
    """CLI arguments of an 8-step toy run: eval and a checkpoint every 4 steps, the loss logged every step.

    Without ``corpus`` the data source is left to ``extra`` (the embedded corpus if it names none).
    """
    data_files = ["--data_files", str(corpus)] if corpus is not None else []
    return [
        "--output_dir", str(output_dir), *data_files, "--config_overrides", json.dumps(TINY_MODEL),
        "--tokenizer_vocab_size", "300", "--block_size", "32", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "16", "--learning_rate", "1e-2", "--warmup_steps", "0", "--max_steps", "8",
        "--save_steps", "4", "--eval_steps", "4", "--logging_steps", "1", "--disable_tqdm", "True", *extra,
    ]  # fmt: skip


def run_main(argv: list[str]) -> tuple[int, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = train.main(argv)
    return status, stdout.getvalue()


def run_interrupted(argv: list[str], global_step: int) -> None:
    """Run the job until it has taken ``global_step`` optimizer steps, then kill it (a KeyboardInterrupt before the
    next step): what it saved until then stays behind, as after a real kill."""
    training_step = KimiK3Trainer.training_step

    def dies_at_the_step(self, *args, **kwargs):
        if self.state.global_step == global_step:
            raise KeyboardInterrupt("simulated interruption")
        return training_step(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KimiK3Trainer, "training_step", dies_at_the_step)
        with pytest.raises(KeyboardInterrupt):
            run_main(argv)


def sampled_continuation(folder: Path) -> str:
    """What scripts/generate.py prints with SAMPLING, computed in this process with the installed code.

    Sampled rather than greedy: a model trained for 8 steps greedily repeats its most frequent token.
    """
    tokenizer = load_tokenizer(folder)
    model = KimiK3ForCausalLM.from_pretrained(folder).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    torch.manual_seed(0)
    output = model.generate(**inputs, max_new_tokens=12, do_sample=True, temperature=1.0, top_k=50)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def generate_in_fresh_process(folder: Path, workdir: Path) -> str:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HOME=str(workdir / "hf-fresh"), HF_HUB_OFFLINE="1")
    args = [str(folder), "--trust_remote_code", "--prompt", PROMPT, *SAMPLING, str(REPO / "scripts/generate.py")]
    # Bytes, not text mode: universal newlines would turn a sampled "\r" before the printed newline into nothing.
    result = subprocess.run(
        [sys.executable, "-I", "-c", GENERATE_IN_FRESH_PROCESS, *args],
        cwd=workdir, env=env, capture_output=True, timeout=HANG_CEILING_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return result.stdout.decode().removesuffix("\n")


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One toy run shared by the tests below: (run folder, corpus, printed report, trainer log history)."""
    root = tmp_path_factory.mktemp("train")
    corpus = write_corpus(root)
    status, printed = run_main(tiny_args(root / "run", corpus))
    assert status == 0
    state = json.loads((root / "run" / "checkpoint-8" / "trainer_state.json").read_text())
    return root / "run", corpus, printed, state["log_history"]


# ---------------------------------------------------------------------------------------------------------------------
# Data and tokenizer
# ---------------------------------------------------------------------------------------------------------------------
def test_embedded_corpus_is_deterministic_and_holds_out_disjoint_documents():
    first, second = data.embedded_corpus(), data.embedded_corpus()
    assert first["text"] == second["text"]
    assert len(first) > 500 and sum(map(len, first["text"])) > 500_000
    splits = data.train_validation_split(first, 5)
    assert len(splits["validation"]) == math.ceil(0.05 * len(first))
    assert len(splits["train"]) + len(splits["validation"]) == len(first)
    assert not set(splits["train"]["text"]) & set(splits["validation"]["text"])
    assert splits["validation"]["text"] == data.train_validation_split(second, 5)["validation"]["text"]


def test_bpe_tokenizer_round_trips_any_text_and_reloads_with_autotokenizer(tmp_path):
    tokenizer = train_bpe_tokenizer(data.reference_topics()[:20], vocab_size=400)
    assert len(tokenizer) == 400
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "def f(x):\n    return x ** 2  # naïve ✓ 数"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == ids


@pytest.mark.parametrize("packing", data.PACKING_MODES)
def test_blocks_are_full_and_join_documents_with_eos(packing):
    tokenizer = train_bpe_tokenizer(["aa bb cc"] * 10, vocab_size=300)
    document = tokenizer("aa bb cc")["input_ids"] + [tokenizer.eos_token_id]
    splits = data.train_validation_split(data.datasets.Dataset.from_dict({"text": ["aa bb cc"] * 40}), 10)
    blocks = data.tokenize_into_blocks(splits, tokenizer, block_size=8, packing=packing)
    assert len(blocks["train"]) == 36 * len(document) // 8 and len(blocks["validation"]) == 4 * len(document) // 8
    stream = [token for block in blocks["train"]["input_ids"] for token in block]
    assert stream == (document * 36)[: len(stream)]
    if packing == "concatenate":
        assert blocks["train"]["labels"] == blocks["train"]["input_ids"]
        assert "position_ids" not in blocks["train"].column_names


def test_document_blocks_restart_positions_at_every_document_and_block_and_ignore_those_labels():
    """Documents of 2, 4 and 1 tokens (+ EOS) in blocks of 5: the layout of DataCollatorWithFlattening per block."""
    tokenizer = train_bpe_tokenizer(["aa bb cc dd ee"] * 10, vocab_size=300)
    texts = ["aa bb", "aa bb cc dd", "ee"]
    lengths = [len(ids) + 1 for ids in tokenizer(texts)["input_ids"]]
    assert lengths == [3, 5, 2]
    blocks = data.tokenize_into_blocks(data.datasets.DatasetDict(
        {"train": data.datasets.Dataset.from_dict({"text": texts})}), tokenizer, block_size=5)["train"]
    assert blocks["position_ids"] == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    stream = [token for block in blocks["input_ids"] for token in block]
    expected = [-100 if position == 0 else token
                for token, position in zip(stream, [p for block in blocks["position_ids"] for p in block])]
    assert [label for block in blocks["labels"] for label in block] == expected


def test_unknown_packing_mode_is_refused_naming_the_flag():
    with pytest.raises(data.DataError, match=r"--packing must be one of documents, concatenate, got 'documnets'"):
        data.tokenize_into_blocks({}, None, 8, packing="documnets")


# ---------------------------------------------------------------------------------------------------------------------
# Training, reloading, model card
# ---------------------------------------------------------------------------------------------------------------------
def test_training_lowers_loss_and_reports_eval_perplexity(trained):
    run, _, printed, history = trained
    losses = [entry["loss"] for entry in history if "loss" in entry]
    evals = [entry for entry in history if "eval_loss" in entry]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3
    assert [entry["step"] for entry in evals] == [4, 8]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(entry["eval_perplexity"] == pytest.approx(math.exp(entry["eval_loss"])) for entry in evals)
    assert f"first training loss {losses[0]:.4f} -> last {losses[-1]:.4f}" in printed
    assert f"eval perplexity {math.exp(evals[-1]['eval_loss']):.2f}" in printed
    assert f"kimi-k3-train: {allocator_description()}" in printed
    threads = os.environ["OMP_NUM_THREADS"]  # tests/conftest.py's; the job's own choice is tests/job/test_threads.py's
    assert f"kimi-k3-train: intra-op threads: {threads} (OMP_NUM_THREADS={threads})" in printed
    assert any("balance/max_vio" in entry for entry in history)
    assert sorted(path.name for path in run.iterdir()) == RUN_FOLDER


def test_default_run_clips_attention_logits_at_100_and_logs_the_statistics(trained):
    run, _, _, history = trained
    logged = [entry for entry in history if "loss" in entry]
    assert all({"qk_clip/clipped_heads", "qk_clip/max_logit", "qk_clip/max_logit_after"} <= entry.keys()
               for entry in logged)
    # The toy model's logits stay far below K2's tau = 100: recorded every step, nothing clipped.
    assert all(entry["qk_clip/clipped_heads"] == 0 for entry in logged)
    assert all(0 < entry["qk_clip/max_logit"] == entry["qk_clip/max_logit_after"] < 100 for entry in logged)


def test_qk_clip_tau_none_turns_recording_and_clipping_off(trained, tmp_path):
    extra = ["--qk_clip_tau", "none", "--max_steps", "2", "--save_steps", "2", "--eval_steps", "2"]
    assert run_main(tiny_args(tmp_path / "run", trained[1], *extra))[0] == 0
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert not any("qk_clip/max_logit" in entry for entry in state["log_history"])


FLUSHING_JOB = """
import json, sys
from kimi_k3.job.main import main
from kimi_k3.kernels.subnormals import subnormal_results
status = main(json.loads(sys.argv[1]))
print(json.dumps([status, *subnormal_results()]))
"""


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="this CPU cannot flush subnormals")
def test_flush_subnormals_trains_with_every_thread_flushing_and_records_the_setting(trained, tmp_path):
    """In a process of its own (the setting stays on its threads): the job flushes subnormals on every intra-op thread
    and records the choice with the run's settings, which a resume must keep."""
    _, corpus, _, _ = trained
    argv = tiny_args(tmp_path / "run", corpus, "--flush_subnormals", "--max_steps", "2", "--save_steps", "2",
                     "--eval_steps", "2")
    result = subprocess.run([sys.executable, "-c", FLUSHING_JOB, json.dumps(argv)], cwd=REPO, capture_output=True,
                            text=True, timeout=HANG_CEILING_S)
    assert result.returncode == 0, result.stderr[-3000:]
    status, subnormal, products = json.loads(result.stdout.splitlines()[-1])
    assert status == 0 and subnormal == 0 and products > 0
    assert json.loads((tmp_path / "run" / "checkpoint-2" / "run_settings.json").read_text())["flush_subnormals"]


def test_cli_reentrant_activation_checkpointing_trains_the_same_losses(trained, tmp_path, monkeypatch):
    uses_reentrant, checkpoint = [], transformers.modeling_utils.checkpoint

    def recording_checkpoint(function, *args, **kwargs):
        uses_reentrant.append(kwargs["use_reentrant"])
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", recording_checkpoint)
    extra = ["--gradient_checkpointing", "True", "--gradient_checkpointing_kwargs", '{"use_reentrant": true}']
    assert run_main(tiny_args(tmp_path / "run", trained[1], *extra))[0] == 0
    # Every layer of every training forward (9 layers x 8 steps) ran checkpointed; evaluation runs no backward.
    assert uses_reentrant == [True] * 9 * 8
    state = json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert losses == [entry["loss"] for entry in trained[3] if "loss" in entry]


def test_saved_folder_generates_in_fresh_process_through_auto_classes(trained, tmp_path):
    model_dir = trained[0] / "model"
    assert {"configuration_kimi_k3.py", "modeling_kimi_k3.py", "tokenizer.json", "README.md"} <= {
        path.name for path in model_dir.iterdir()
    }
    expected = sampled_continuation(model_dir)
    assert expected.startswith(PROMPT) and expected.removeprefix(PROMPT).strip()
    assert generate_in_fresh_process(model_dir, tmp_path) == expected


def load_tokenizer_in_fresh_process(folder: Path, workdir: Path, *ways: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HOME=str(workdir / "hf-fresh"), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-I", "-c", LOAD_TOKENIZER_IN_FRESH_PROCESS, str(folder), PROMPT, *ways],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=HANG_CEILING_S,
    )  # fmt: skip


def test_saved_folder_tokenizer_loads_without_prompt_or_warning(trained, tmp_path):
    """The documented ways: the folder's AutoConfig trusted (only its configuration file runs), or the tokenizer
    class itself, which never reads config.json."""
    ids = load_tokenizer(trained[0] / "model")(PROMPT)["input_ids"]
    result = load_tokenizer_in_fresh_process(trained[0] / "model", tmp_path, "auto, trusting the folder", "fast")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.splitlines() == [str(ids)] * 2


@pytest.mark.xfail(
    strict=True,
    reason="transformers 5.23-5.24 resolve a folder's AutoConfig before its tokenizer_config.json, and a config.json "
    "with auto_map is remote code: a trust prompt, then a bare-config warning, although tokenizer_class is declared",
)
def test_saved_folder_tokenizer_loads_through_plain_autotokenizer_silently(trained, tmp_path):
    result = load_tokenizer_in_fresh_process(trained[0] / "model", tmp_path, "auto")
    assert json.loads((trained[0] / "model" / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert result.returncode == 0 and result.stderr == "" and "custom code" not in result.stdout


def test_model_card_states_metadata_parameter_counts_and_results(trained):
    from huggingface_hub import ModelCard

    run, _, _, history = trained
    card = ModelCard.load(run / "model" / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"custom_code", "kimi_k3", "moe"} <= set(card.data.tags)
    model = KimiK3ForCausalLM.from_pretrained(run / "model")
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    # 8 MoE layers x E experts x (gate + up + down) = 8 * 8 * 3 * 16 * 24; a token uses k = 2 of the 8.
    routed = 8 * config.num_experts * 3 * config.moe_intermediate_size * config.routed_expert_hidden_size
    active = total - config.vocab_size * config.hidden_size - routed * 6 // 8
    assert f"| routed experts | {routed:,} |" in card.text
    assert f"| total | {total:,} |" in card.text and f"**{active:,}**" in card.text
    final_eval = [entry for entry in history if "eval_loss" in entry][-1]
    assert f"| final eval loss | {final_eval['eval_loss']:.3f} |" in card.text
    assert card.text.count("| layer_") == 8
    assert "| QK-Clip | tau = 100 |" in card.text and "| quantization-aware training | none |" in card.text
    assert "| weights on disk | this project's layout, float32 |" in card.text
    assert "| packing | documents: each block keeps its document boundaries" in card.text
    assert "| parallelism | one CPU process |" in card.text and "| autocast | none (fp32 compute) |" in card.text


def test_model_card_shows_no_local_path_and_a_usage_snippet_that_loads(trained, tmp_path, monkeypatch):
    """The run folder lies outside the working directory here: the snippet names a placeholder the card explains."""
    run = trained[0]
    text = (run / "model" / "README.md").read_text()
    assert str(run.parent) not in text and "| data | local files: corpus.txt |" in text
    assert 'from_pretrained("path/to/model", trust_remote_code=True)' in text and 'from_pretrained("run"' not in text
    monkeypatch.chdir(tmp_path)
    assert final_save.local_folder_name(tmp_path / "outputs" / "run" / "model") == "outputs/run/model"
    assert final_save.local_folder_name(Path("outputs/run/model")) == "outputs/run/model"
    assert final_save.local_folder_name(run / "model") == "path/to/model"


@pytest.mark.skipif(not matplotlib_available(), reason="matplotlib (the [plot] extra) is not installed")
def test_expert_load_picture_is_in_model_and_run_folder_and_in_the_card(trained):
    run = trained[0]
    picture = (run / "model" / "expert_load.png").read_bytes()
    assert picture == (run / "expert_load.png").read_bytes()
    assert picture.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", picture[16:24])  # the IHDR chunk
    assert width > 2 * height > 500  # two heatmaps and the MaxVio curve side by side
    card = (run / "model" / "README.md").read_text()
    assert "## Expert load during training" in card and "](expert_load.png)" in card


def test_expert_load_recorder_keeps_first_and_last_step_of_the_balancing_callbacks_loads():
    model = KimiK3ForCausalLM(tiny_config()).train()
    balancing = QuantileBalancing(model, per_layer_metrics=False)
    balancing.attach()
    recorder, state, reported = ExpertLoadRecorder(balancing), TrainerState(), []
    for step in (1, 2, 3):
        model(input_ids=torch.randint(3, 97, (2, 16)))
        state.global_step = step
        balancing.update()  # what the optimizer's step hook runs, before the step ends
        recorder.on_step_end(None, state, None, model=model)
        reported.append({layer: load.clone() for layer, load in balancing.latest_loads.items()})

    (first_step, first), (last_step, last) = recorder.snapshots()
    assert (first_step, last_step) == (1, 3) and len(first) == 8
    assert all(torch.equal(first[layer], reported[0][layer]) and torch.equal(last[layer], reported[2][layer])
               for layer in first)  # fmt: skip
    assert all(int(load.sum()) == 2 * 16 * 2 for load in first.values())  # every token visits top-k = 2 experts
    share = token_share(first)
    assert share.shape == (8, 8) and torch.allclose(share.mean(-1), torch.ones(8, dtype=torch.float64))
    assert torch.equal(share[0], first["layer_1"].double() * 8 / 64)


def test_run_without_matplotlib_or_network_says_so_once_and_keeps_the_model(trained, tmp_path, monkeypatch, capsys):
    """No picture and one line naming the extra; a push that cannot reach the hub ends the job with exit status 1,
    one line, and the command that publishes the saved model later."""
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` now raises ImportError
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")  # HF_HUB_OFFLINE=1 (conftest) makes the push fail
    monkeypatch.setattr(train.hub, "check_token", lambda *args: None)  # as if the network dropped after the check
    extra = ["--max_steps", "2", "--save_steps", "2", "--eval_strategy", "no", "--hub_model_id", "someone/tiny"]
    status, printed = run_main(tiny_args(tmp_path / "run", trained[1], *extra))
    assert status == 1 and printed.count(PLOT_EXTRA) == 1
    assert "kimi-k3-train: matplotlib is not installed, so no expert-load picture is drawn" in printed
    assert not list((tmp_path / "run").rglob("*.png"))
    assert "expert_load.png" not in (tmp_path / "run" / "model" / "README.md").read_text()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("kimi-k3-train: error: cannot push while HF_HUB_OFFLINE is set")
    assert error.endswith(f"`kimi-k3-push {tmp_path / 'run' / 'model'} --hub_model_id someone/tiny`")


def test_card_language_defaults_to_english_for_the_embedded_corpus_only(tmp_path):
    card_args, model_args = arguments.CardArguments(), arguments.ModelArguments()
    assert arguments.card_settings(card_args, model_args, arguments.DataArguments()) == {"language": ["en"]}
    assert arguments.card_settings(card_args, model_args, arguments.DataArguments(data_files=["a.txt"])) == {}
    # A dataset by hub id is the card's dataset; a local dataset folder is not.
    named = arguments.DataArguments(dataset_name="someone/corpus")
    assert arguments.card_settings(card_args, model_args, named) == {"datasets": ["someone/corpus"]}
    assert arguments.card_settings(card_args, model_args, arguments.DataArguments(dataset_name=str(tmp_path))) == {}


# ---------------------------------------------------------------------------------------------------------------------
# Resume and atomic saving
# ---------------------------------------------------------------------------------------------------------------------
def test_resume_after_interruption_matches_uninterrupted_run_bit_exactly_and_its_card_spans_both_jobs(trained, tmp_path):
    uninterrupted, corpus, _, _ = trained
    run_interrupted(tiny_args(tmp_path / "run", corpus), global_step=5)
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["checkpoint-4"]
    first_job = callback_states(tmp_path / "run" / "checkpoint-4")["TrainingClock"]["attributes"]

    assert run_main(tiny_args(tmp_path / "run", corpus, "--resume_from_checkpoint", "True"))[0] == 0
    expected, resumed = weights(uninterrupted / "model"), weights(tmp_path / "run" / "model")
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[key], resumed[key]) for key in expected)
    bias = resumed["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0  # Quantile Balancing moved the bias, and it was restored exactly
    expected_state = torch.load(uninterrupted / "checkpoint-8" / "optimizer.pt")["state"]
    resumed_state = torch.load(tmp_path / "run" / "checkpoint-8" / "optimizer.pt")["state"]
    assert expected_state.keys() == resumed_state.keys()
    assert all(
        torch.equal(expected_state[param][name], resumed_state[param][name])
        for param in expected_state
        for name in expected_state[param]
    )
    # The expert-load picture's snapshots (steps 1 and 8) and the wall time cover the job before the resume too.
    expected_callbacks = callback_states(uninterrupted / "checkpoint-8")
    resumed_callbacks = callback_states(tmp_path / "run" / "checkpoint-8")
    assert resumed_callbacks["ExpertLoadRecorder"] == expected_callbacks["ExpertLoadRecorder"]
    assert [snapshot[0] for snapshot in resumed_callbacks["ExpertLoadRecorder"]["attributes"].values()] == [1, 8]
    clock = resumed_callbacks["TrainingClock"]["attributes"]
    assert clock["resumed_at"] == [4] and clock["earlier_s"] > first_job["earlier_s"] > 0
    wall_time = re.search(r"\| wall time \| (\d+) s, over 2 jobs \(resumed at step 4\) \|",
                          (tmp_path / "run" / "model" / "README.md").read_text())  # fmt: skip
    assert wall_time and int(wall_time[1]) >= round(clock["earlier_s"])


def callback_states(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]


def test_full_disk_is_one_line_and_leaves_previous_checkpoint_and_model_loadable(trained, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    before = {name: weights(run / name) for name in ("checkpoint-8", "model")}

    def dies_midway(state_dict, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    model = KimiK3ForCausalLM.from_pretrained(run / "model")
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", dies_midway)
    assert run_main(tiny_args(run, trained[1], "--resume_from_checkpoint", "True", "--max_steps", "12"))[0] == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == (
        f"kimi-k3-train: error: saving checkpoint-12 in {run} failed (the disk is full): [Errno 28] No space left on "
        "device; nothing partial was published"
    )
    with pytest.raises(SaveError, match="saving model .* failed \\(the disk is full\\)"):
        card = render_model_card(model, "tiny")
        final_save.save_final_model(model, load_tokenizer(run / "model"), card, run / "model")

    assert sorted(path.name for path in run.iterdir()) == RUN_FOLDER
    for name, tensors in before.items():
        reloaded = KimiK3ForCausalLM.from_pretrained(run / name).state_dict()
        assert weights(run / name).keys() == tensors.keys()
        assert torch.equal(reloaded["lm_head.weight"], tensors["lm_head.weight"])


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize("ns_dtype", ["bfloat16", "float32"])
def test_resume_is_bit_exact_with_newton_schulz_forced_to_either_precision(ns_dtype, tmp_path):
    """``--muon_ns_dtype auto`` takes one of the two on a given CPU; both paths are held to a bit-exact resume here."""
    corpus = write_corpus(tmp_path)
    forced = ("--muon_ns_dtype", ns_dtype)
    assert run_main(tiny_args(tmp_path / "uninterrupted", corpus, *forced))[0] == 0
    run_interrupted(tiny_args(tmp_path / "run", corpus, *forced), global_step=5)
    assert run_main(tiny_args(tmp_path / "run", corpus, *forced, "--resume_from_checkpoint", "True"))[0] == 0
    expected, resumed = weights(tmp_path / "uninterrupted" / "model"), weights(tmp_path / "run" / "model")
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[key], resumed[key]) for key in expected)


def test_resuming_a_finished_run_trains_no_step_and_leaves_model_bit_identical(trained, tmp_path):
    run = shutil.copytree(trained[0], tmp_path / "run")
    before = folder_bytes(run / "model")
    status, printed = run_main(tiny_args(run, trained[1], "--resume_from_checkpoint", "True"))
    assert status == 0 and "already finished at step 8" in printed
    assert folder_bytes(run / "model") == before
    assert sorted(path.name for path in run.iterdir()) == RUN_FOLDER


def test_resuming_a_finished_released_layout_run_leaves_model_bit_identical(tmp_path):
    """The final folder holds MXFP4 experts under the released names, so its tensors are not the checkpoint's: it
    records the checkpoint it was made from, and a run that ends at that checkpoint leaves it alone."""
    corpus = write_corpus(tmp_path)
    args = tiny_args(tmp_path / "run", corpus, "--config_overrides", json.dumps(TINY_MODEL | MXFP4_WIDTHS),
                     "--final_layout", "released", "--max_steps", "4")  # fmt: skip
    assert run_main(args)[0] == 0
    before = folder_bytes(tmp_path / "run" / "model")
    status, printed = run_main([*args, "--resume_from_checkpoint", "True"])
    assert status == 0 and "already finished at step 4" in printed and "nothing to do" in printed
    assert folder_bytes(tmp_path / "run" / "model") == before


def test_run_killed_during_final_save_resumes_to_the_uninterrupted_model(trained, tmp_path):
    run = shutil.copytree(trained[0], tmp_path / "run")
    shutil.rmtree(run / "model")
    (run / ".staging-model-0123456789ab").mkdir()  # what the killed save left: a partial staging folder
    (run / ".staging-model-0123456789ab" / "model.safetensors").write_bytes(b"\0" * 100)
    status, printed = run_main(tiny_args(run, trained[1], "--resume_from_checkpoint", "True"))
    assert status == 0 and "8 steps" in printed
    assert sorted(path.name for path in run.iterdir()) == RUN_FOLDER
    expected, resumed = weights(trained[0] / "model"), weights(run / "model")
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[key], resumed[key]) for key in expected)
    for name in ("config.json", "generation_config.json"):  # decoding keeps its cache, as after an uninterrupted run
        assert (run / "model" / name).read_text() == (trained[0] / "model" / name).read_text()


def test_kill_between_the_two_renames_of_model_is_recovered(trained, tmp_path, monkeypatch):
    run = shutil.copytree(trained[0], tmp_path / "run")
    before = folder_bytes(run / "model")
    rename = os.rename
    calls = []

    def killed_before_second_rename(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        rename(source, target)

    monkeypatch.setattr(run_folder.os, "rename", killed_before_second_rename)
    monkeypatch.setattr(run_folder, "exchange_paths", lambda *args: False)  # where Linux cannot swap in one step
    model = KimiK3ForCausalLM.from_pretrained(run / "model")
    with pytest.raises(KeyboardInterrupt):
        final_save.save_final_model(model, load_tokenizer(run / "model"), render_model_card(model, "tiny"), run / "model")
    monkeypatch.setattr(run_folder.os, "rename", rename)
    assert not (run / "model").exists() and (run / ".model.replaced").is_dir()

    status, printed = run_main(tiny_args(run, trained[1], "--resume_from_checkpoint", "True"))
    assert status == 0 and "restored model" in printed and "already finished" in printed
    assert folder_bytes(run / "model") == before
    assert sorted(path.name for path in run.iterdir()) == RUN_FOLDER


def test_resume_refuses_a_checkpoint_missing_lm_head(trained, tmp_path, capsys):
    run = shutil.copytree(trained[0], tmp_path / "run")
    tensors = weights(run / "checkpoint-8")
    del tensors["lm_head.weight"]
    save_file(tensors, run / "checkpoint-8" / "model.safetensors", metadata={"format": "pt"})
    listing = sorted(path.name for path in run.iterdir())
    assert train.main(tiny_args(run, trained[1], "--resume_from_checkpoint", "True", "--max_steps", "12")) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("kimi-k3-train: error: Refusing the checkpoint: 1 text tensor")
    assert "missing lm_head.weight [300, 32]" in last_line
    assert sorted(path.name for path in run.iterdir()) == listing


def test_resume_with_another_global_batch_warns_naming_both(trained, tmp_path, capsys, monkeypatch):
    run = shutil.copytree(trained[0], tmp_path / "run")
    synced, fsync_tree = [], run_folder.fsync_tree
    monkeypatch.setattr(run_folder, "fsync_tree", lambda folder: synced.append(folder) or fsync_tree(folder))
    extra = ["--resume_from_checkpoint", "True", "--max_steps", "9", "--gradient_accumulation_steps", "2"]
    assert run_main(tiny_args(run, trained[1], *extra))[0] == 0
    # The new checkpoint and the model were fsync'ed under this job's own staging names before being published.
    checkpoint, model = synced
    tag = model.name.removeprefix(".staging-model-")
    assert checkpoint == run / f".staging-checkpoint-9-{tag}" / "checkpoint-9" and len(tag) == 12
    assert json.loads((run / "checkpoint-9" / "batch_size.json").read_text())["global"] == 8
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kimi-k3-train: warning:")]
    assert warnings == [
        f"kimi-k3-train: warning: resuming {run / 'checkpoint-8'} with global batch 8 (4 per device x 2 accumulation "
        "x 1 processes); it was trained with 4 (4 per device x 1 accumulation x 1 processes), so the data order and "
        "the optimizer trajectory differ from the original run"
    ]


# ---------------------------------------------------------------------------------------------------------------------
# One job per output folder
# ---------------------------------------------------------------------------------------------------------------------
HOLD_LOCK = "import sys; from kimi_k3.checkpoint.run_folder import OutputFolderLock; lock = OutputFolderLock(sys.argv[1]).acquire()"


def test_second_job_in_a_locked_folder_fails_at_once_naming_folder_and_holder(trained, tmp_path, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK + "; print('locked', flush=True); sys.stdin.read()", str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.perf_counter()
        assert train.main(tiny_args(tmp_path / "out", trained[1])) == 2
        assert time.perf_counter() - started < 5
    finally:
        holder.communicate("", timeout=HANG_CEILING_S)
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith(
        f"kimi-k3-train: error: --output_dir {tmp_path / 'out'} is in use by another job (pid {holder.pid} on "
        f"{socket.gethostname()}, running since "
    )
    assert [path.name for path in (tmp_path / "out").iterdir()] == [run_folder.LOCK_NAME]  # the job wrote nothing


def test_torch_save_short_write_counts_as_a_full_disk():
    assert run_folder.is_disk_full(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 686016 vs 685908"))
    assert run_folder.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not run_folder.is_disk_full(OSError(errno.EACCES, "Permission denied"))


def test_lock_of_a_killed_job_is_not_stuck(tmp_path):
    holder = subprocess.run(
        [sys.executable, "-c", HOLD_LOCK + "; import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
         str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=HANG_CEILING_S,
    )  # fmt: skip
    assert holder.returncode == -signal.SIGKILL and (tmp_path / "out" / run_folder.LOCK_NAME).exists()
    with run_folder.OutputFolderLock(tmp_path / "out") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_publication_fsyncs_every_file_and_directory_before_the_rename_under_a_unique_staging_name(
    trained, tmp_path, monkeypatch
):
    events = []
    fsync, rename = os.fsync, os.rename

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_rename(source, target):
        events.append(("rename", str(source), str(target)))
        rename(source, target)

    monkeypatch.setattr(run_folder.os, "fsync", recording_fsync)
    monkeypatch.setattr(run_folder.os, "rename", recording_rename)
    model = KimiK3ForCausalLM.from_pretrained(trained[0] / "model")
    target = tmp_path / "model"
    final_save.save_final_model(model, load_tokenizer(trained[0] / "model"), render_model_card(model, "tiny"), target, "t1")
    (rename_index,) = [i for i, event in enumerate(events) if event[0] == "rename"]
    staged = tmp_path / ".staging-model-t1"
    assert events[rename_index] == ("rename", str(staged), str(target))
    synced = {event[1] for event in events[:rename_index]}
    assert {str(staged / path.name) for path in target.iterdir()} | {str(staged)} <= synced
    assert events[rename_index + 1:] == [("fsync", str(tmp_path))]
    assert run_folder.new_tag() != run_folder.new_tag()


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_read_only_output_folder_is_refused_before_training(trained, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode == 0
    if os.geteuid() == 0 and not immutable:
        pytest.skip("root ignores permission bits and this filesystem refuses chattr +i")
    try:
        assert train.main(tiny_args(out, trained[1])) == 2
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(out)], check=True)
        out.chmod(0o755)
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith(f"kimi-k3-train: error: --output_dir {out}: cannot write in {out} (")
    assert list(out.iterdir()) == []


def test_adamw_without_quantile_balancing_trains_and_leaves_router_bias_at_zero(trained, tmp_path):
    extra = ["--optimizer", "adamw", "--no_quantile_balancing", "--max_steps", "2"]
    assert run_main(tiny_args(tmp_path / "run", trained[1], *extra))[0] == 0
    assert "| optimizer | Trainer's `adamw_torch" in (tmp_path / "run" / "model" / "README.md").read_text()
    saved = weights(tmp_path / "run" / "model")
    biases = [tensor for key, tensor in saved.items() if key.endswith("e_score_correction_bias")]
    assert len(biases) == 8 and all(torch.count_nonzero(bias) == 0 for bias in biases)
    assert "router balancing | none" in (tmp_path / "run" / "model" / "README.md").read_text()


def test_optim_alone_trains_with_that_trainer_optimizer_and_the_card_names_it(trained, tmp_path, monkeypatch):
    created = []
    create_optimizer = KimiK3Trainer.create_optimizer
    monkeypatch.setattr(KimiK3Trainer, "create_optimizer",
                        lambda self: created.append(type(create_optimizer(self)).__name__) or self.optimizer)
    assert run_main(tiny_args(tmp_path / "run", trained[1], "--optim", "adafactor", "--max_steps", "2"))[0] == 0
    assert created == ["Adafactor"]
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "| optimizer | Trainer's `adafactor` (--optim), peak learning rate 0.01 |" in card


def test_report_to_tensorboard_receives_the_balance_and_qk_clip_metrics_of_every_logged_step(trained, tmp_path):
    assert run_main(tiny_args(tmp_path / "run", trained[1], "--report_to", "tensorboard", "--max_steps", "3"))[0] == 0
    (events,) = (tmp_path / "run" / "runs").iterdir()  # Trainer's default logging folder
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    logged = json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    train_logs = [entry for entry in logged if "loss" in entry]
    assert len(train_logs) == 3
    for key in ("balance/max_vio", "balance/cv", "qk_clip/max_logit", "qk_clip/clipped_heads"):
        reported = [event.value for event in accumulator.Scalars(f"train/{key}")]
        assert reported == pytest.approx([entry[key] for entry in train_logs], rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: a clear message, a non-zero status, nothing written
# ---------------------------------------------------------------------------------------------------------------------
def bigger_tokenizer(folder: Path) -> str:
    train_bpe_tokenizer(data.reference_topics()[:20], vocab_size=400).save_pretrained(folder)
    return str(folder)


ALL_KDA = ["linear_attention"] * 9
BAD_INPUTS = {
    "missing data file": (lambda run, tmp: ["--data_files", str(tmp / "nope.txt")], "no such file"),
    "empty corpus": (lambda run, tmp: ["--data_files", str(write_blank(tmp))], "corpus is empty"),
    "tokenizer larger than the model vocab": (
        lambda run, tmp: ["--model_name_or_path", f"{run}/model", "--tokenizer_name_or_path", bigger_tokenizer(tmp)],
        "vocab_size is 300",
    ),
    "hub id without a token": (lambda run, tmp: ["--hub_model_id", "someone/kimi-k3-tiny"], "needs a token: pass --hub_token"),
    "license that is not a hub id": (
        lambda run, tmp: ["--license", "apache2"], "license 'apache2' is not a hub license identifier; did you mean 'apache-2.0'?"
    ),
    "custom license without a link": (
        lambda run, tmp: ["--license", "other", "--license_name", "acme"], "--license other needs --license_name NAME"
    ),
    "language name instead of code": (lambda run, tmp: ["--language", "English"], "--language 'English' is not an ISO"),
    "resume without a checkpoint": (lambda run, tmp: ["--resume_from_checkpoint", "True"], "no checkpoint-N folder"),
    "bad config override": (lambda run, tmp: ["--config_overrides", '{"hidden_act": "tanh"}'],
                            "model config: Field 'hidden_act' expected one of ('situ', 'silu', 'gelu', 'relu'), got tanh"),
    "negative qk_clip_tau": (lambda run, tmp: ["--qk_clip_tau", "-1"], "--qk_clip_tau must be a number > 0"),
    "NaN qk_clip_tau": (lambda run, tmp: ["--qk_clip_tau", "nan"], "--qk_clip_tau must be a number > 0"),
    "QK-Clip without MLA layers": (
        lambda run, tmp: ["--config_overrides", json.dumps({**TINY_MODEL, "layer_types": ALL_KDA,
                                                            "use_cache": False})],
        "the model has no MLA (full_attention) layer; pass --qk_clip_tau none",
    ),
    "0-byte text file": (lambda run, tmp: ["--data_files", str(write_bytes(tmp, "empty.txt", b""))], "empty.txt is empty (0 bytes)"),
    "binary text file": (
        lambda run, tmp: ["--data_files", str(write_bytes(tmp, "bin.txt", b"ELF\x00\x01 header"))],
        "bin.txt is binary, not text (NUL byte at offset 3)",
    ),
    "non-UTF-8 text file": (
        lambda run, tmp: ["--data_files", str(write_bytes(tmp, "latin1.txt", "café au lait".encode("latin-1")))],
        "latin1.txt is not UTF-8 text (byte 0xe9 at offset 3)",
    ),
    "JSON text field holding a number": (
        lambda run, tmp: ["--data_files", str(write_bytes(tmp, "mixed.jsonl", b'{"text": "a b"}\n{"text": 5}\n'))],
        "column 'text' must hold text, but row 1 holds int 5",
    ),
    "block size above max positions": (
        lambda run, tmp: ["--block_size", "1024"], "--block_size 1024 exceeds the model's max_position_embeddings (512)"
    ),
    "eval batch size 0": (lambda run, tmp: ["--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size must be >= 1, got 0"),
    "train batch size 0": (lambda run, tmp: ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be >= 1"),
    "misspelt config field": (
        lambda run, tmp: ["--config_overrides", '{"hiden_size": 64}'], "no field 'hiden_size'; did you mean 'hidden_size'?"
    ),
    "string config value": (
        lambda run, tmp: ["--config_overrides", '{"rms_norm_eps": "1e-6"}'], "model config: Field 'rms_norm_eps' expected float, got str (value: '1e-6')"
    ),
    "--optim with Per-Head Muon": (
        lambda run, tmp: ["--optimizer", "per_head_muon", "--optim", "adafactor"],
        "--optim adafactor chooses Trainer's optimizer, which --optimizer per_head_muon replaces: pass --optimizer adamw",
    ),
    "string routed scaling factor": (
        lambda run, tmp: ["--config_overrides", '{"routed_scaling_factor": "2.5"}'], "model config: Field 'routed_scaling_factor' expected float, got str"
    ),
    "two routing variants at once": (
        lambda run, tmp: ["--config_overrides", json.dumps({**TINY_MODEL, "dynamic_experts_per_token": True,
                                                            "router_score_normalization": "quantile"})],
        "each replace the router's selection rule; enable at most one",
    ),
    "variant the released layout cannot hold": (
        lambda run, tmp: ["--config_overrides", json.dumps({**TINY_MODEL, "attention_gate_routing": True,
                                                            **MXFP4_WIDTHS}), "--final_layout", "released"],
        "--final_layout released: the released layout cannot represent routing-modulated attention gates",
    ),
    "QAT of shared-basis experts": (
        lambda run, tmp: ["--config_overrides", json.dumps({**TINY_MODEL, "expert_basis_size": 2, **MXFP4_WIDTHS}),
                          "--qat", "mxfp4"],
        "QAT mxfp4 fake-quantizes each routed expert's own weight tensors",
    ),
    "expert merging threshold above 1": (
        lambda run, tmp: ["--expert_merging_every_n_steps", "5", "--expert_merging_threshold", "1.5"],
        "--expert_merging_threshold is a cosine similarity in [-1, 1], got 1.5",
    ),
    "negative merging period": (
        lambda run, tmp: ["--expert_merging_every_n_steps", "-2"], "--expert_merging_every_n_steps must be >= 0",
    ),
}
MXFP4_WIDTHS = {"routed_expert_hidden_size": 32, "moe_intermediate_size": 32}


def write_bytes(folder: Path, name: str, content: bytes) -> Path:
    (folder / name).write_bytes(content)
    return folder / name


def write_blank(folder: Path) -> Path:
    blank = folder / "blank.txt"
    blank.write_text("\n   \n\n")
    return blank


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_nonzero_with_message_and_writes_nothing(case, trained, tmp_path, monkeypatch, capsys):
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    extra, message = BAD_INPUTS[case]
    args = tiny_args(tmp_path / "out", trained[1]) + extra(trained[0], tmp_path)
    status = train.main(args)
    assert status == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("kimi-k3-train: error:") and message in last_line
    assert not (tmp_path / "out").exists()


def test_processes_that_trainer_would_not_join_stop_with_the_use_cpu_hint(trained, tmp_path, monkeypatch, capsys):
    # A launcher's WORLD_SIZE, while Trainer (no GPU, no --use_cpu True) sees a world size of 1.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(tiny_args(tmp_path / "out", trained[1])) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "WORLD_SIZE=2" in last_line and last_line.endswith("pass --use_cpu True")
    assert not (tmp_path / "out").exists()


def test_fresh_run_refuses_output_dir_holding_another_runs_checkpoints(trained, capsys):
    run = trained[0]
    before = sorted(path.name for path in run.iterdir())
    assert train.main(tiny_args(run, trained[1])) == 2
    assert "--resume_from_checkpoint True" in capsys.readouterr().err
    assert sorted(path.name for path in run.iterdir()) == before


def test_help_gives_each_flag_its_own_text(capsys):
    with pytest.raises(SystemExit):
        arguments.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--no-quantile-balancing Leave the router bias alone" in help_text
    assert help_text.count("Update the router bias with Quantile Balancing") == 1
    assert "--no-fused-situ Train with the model's eager SiTU-GLU" in help_text
    assert help_text.count("Compile SiTU-GLU and its backward") == 1


def test_defaults_pin_host_memory_and_trade_determinism_by_device(tmp_path):
    """Pinned memory only helps copies to an accelerator (on a CPU torch warns about it at every data loader); on a
    CPU the job runs torch's deterministic kernels, so that runs with several threads repeat bit for bit."""
    training_args = arguments.parse_args(["--output_dir", str(tmp_path)])[3]
    assert training_args.dataloader_pin_memory == torch.accelerator.is_available()
    assert training_args.full_determinism == (not torch.accelerator.is_available())


REPEATED_BACKWARD = """
import sys, tempfile, torch
from transformers.trainer_utils import enable_full_determinism
from configuration_kimi_k3 import KimiK3Config
from kimi_k3.job import arguments
from kimi_k3.job.trainer import skip_filling_uninitialized_memory
from modeling_kimi_k3 import KimiK3ForCausalLM
args = arguments.parse_args(["--output_dir", tempfile.mkdtemp()])[3]
if args.full_determinism:
    enable_full_determinism(args.seed)  # what Trainer does with it
    skip_filling_uninitialized_memory()  # and what the job's Trainer adds
model = KimiK3ForCausalLM(KimiK3Config(vocab_size=4096)).train()
ids = torch.randint(3, 4096, (8, 128), generator=torch.Generator().manual_seed(1))
def gradients():
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]
differing = sum(not torch.equal(a, b) for a, b in zip(gradients(), gradients()))
sys.exit(f"{differing} gradients differ between identical backward passes" if differing else 0)
"""


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the job keeps fast kernels on accelerators")
def test_job_defaults_make_a_two_thread_cpu_backward_repeat_bit_for_bit():
    """With two threads, two identical backward passes of the default model differed in all 228 gradients; the job's
    default (full_determinism on a CPU) makes them equal."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", REPEATED_BACKWARD], env=env, capture_output=True, text=True,
                            timeout=HANG_CEILING_S)
    assert result.returncode == 0, result.stderr[-2000:]


def _deterministic_job_steps(fill_uninitialized_memory: bool, steps: int = 2) -> list[torch.Tensor]:
    """Weights and router biases after ``steps`` of the job's optimizer and policies, under deterministic kernels."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory
    try:
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(tiny_config()).train()
        optimizer = PerHeadMuon.for_model(model, lr=3e-3, weight_decay=0.1)
        QuantileBalancing(model).attach(optimizer, model)
        QKClip(model, 1.0).attach(optimizer, model)  # a low threshold, so that the clip rescales heads
        ids = torch.randint(3, 97, (3, 37), generator=torch.Generator().manual_seed(1))
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [tensor.detach().clone() for tensor in (*model.parameters(), *model.buffers())]
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = True


def test_training_steps_read_no_uninitialized_memory_so_skipping_the_fill_keeps_every_bit():
    """The job's Trainer turns off torch's NaN-filling of new tensors under deterministic algorithms: were any kernel of
    the step reading memory it never wrote, the filled run would differ (NaN) from the unfilled one."""
    filled, unfilled = _deterministic_job_steps(True), _deterministic_job_steps(False)
    assert all(torch.isfinite(tensor).all() for tensor in filled)
    assert [torch.equal(a, b) for a, b in zip(filled, unfilled)] == [True] * len(filled)


def test_the_job_trainer_skips_the_fill_only_under_full_determinism(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    model = KimiK3ForCausalLM(tiny_config())
    for full_determinism, filled in ((False, True), (True, False)):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), full_determinism=full_determinism,
                                              report_to="none", use_cpu=True)
        KimiK3Trainer(model=model, args=args)
        assert torch.utils.deterministic.fill_uninitialized_memory is filled
    torch.use_deterministic_algorithms(False)


def test_final_evaluation_reuses_an_evaluation_the_trainer_ran_at_the_last_step():
    evaluated = {"eval_loss": 4.2, "eval_perplexity": 66.7, "step": 8}
    state = TrainerState(global_step=8, log_history=[{"loss": 5.0, "step": 8}, evaluated, {"train_runtime": 3.0}])
    assert train.evaluation_at_last_step(state) == evaluated
    state.log_history.insert(2, {"loss": 4.9, "step": 9})
    state.global_step = 9  # evaluated at step 8, trained on to step 9: evaluate again
    assert train.evaluation_at_last_step(state) is None
    assert train.evaluation_at_last_step(TrainerState(global_step=3)) is None


# ---------------------------------------------------------------------------------------------------------------------
# The opt-in Stable LatentMoE variants through --config_overrides (the 150-step runs are in ablations/README.md)
# ---------------------------------------------------------------------------------------------------------------------
VARIANT_JOBS = {  # the three routing rules exclude each other; the other variants ride along
    "quantile routing, shared basis, attention gates": {"router_score_normalization": "quantile",
                                                        "expert_basis_size": 3, "attention_gate_routing": True},
    "two-level routing": {"num_coarse_experts": 4, "coarse_experts_per_token": 2},
    "dynamic k": {"dynamic_experts_per_token": True},
}


@pytest.mark.parametrize("variant", VARIANT_JOBS)
def test_each_variant_trains_through_config_overrides_and_its_folder_reloads(variant, trained, tmp_path):
    overrides = json.dumps({**TINY_MODEL, **VARIANT_JOBS[variant]})
    args = tiny_args(tmp_path / "run", trained[1], "--config_overrides", overrides, "--max_steps", "4")
    status, printed = run_main(args)
    assert status == 0, printed
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert all(math.isfinite(entry["balance/max_vio"]) for entry in state["log_history"] if "balance/max_vio" in entry)
    saved = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert {key: saved[key] for key in VARIANT_JOBS[variant]} == VARIANT_JOBS[variant]
    model = KimiK3VariantForCausalLM.from_pretrained(tmp_path / "run" / "model").eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]])).logits).all()
