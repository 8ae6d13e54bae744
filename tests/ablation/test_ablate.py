import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from configuration_kimi_k3 import TINY, KimiK3Config
from kimi_k3.ablation import cli, report
from kimi_k3.ablation.measure import evaluation_record
from kimi_k3.ablation.report import difference, mean_and_std, mean_curve, paired_difference, run_machines
from kimi_k3.ablation.rows import QUICK_MODEL, ROWS, AblationError, check_applies
from kimi_k3.text import corpus as data
from tests.conftest import HANG_CEILING_S, ROOT, TINY_CONFIG
from variants_kimi_k3 import causal_lm_class

TINY_MODEL = {key: value for key, value in TINY_CONFIG.items() if key != "vocab_size"}
KDA_ONLY = {**QUICK_MODEL, "use_cache": False, "layer_types": ["linear_attention"] * QUICK_MODEL["num_hidden_layers"]}


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = cli.main(argv)
    return status, stdout.getvalue(), stderr.getvalue()


# ---------------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "--preset huge: unknown preset; presets are quick, full"),
    (["--rows", "adamw", "sparse-attention"], "--rows: unknown row 'sparse-attention'; rows are baseline, "),
    (["--rows", "no-qk-clip", "--config_overrides", json.dumps(KDA_ONLY)],
     "row 'no-qk-clip' cannot apply: the baseline config has no MLA (full_attention) layer"),
    (["--rows", "plain-residual", "--config_overrides", '{"attn_res_block_size": null}'],
     "row 'plain-residual' cannot apply: the baseline config has no Block Attention Residuals"),
    (["--rows", "latent-width-d", "--config_overrides", json.dumps({"routed_expert_hidden_size": TINY["hidden_size"]})],
     "row 'latent-width-d' cannot apply: the baseline config has no latent projection"),
    (["--seeds", "0", "0"], "--seeds must be distinct integers >= 0, got [0, 0]"),
    (["--job_args", "--no_such_option 1"], "row 'baseline': kimi-k3-train refuses its options: "),
])  # fmt: skip
def test_bad_input_is_refused_in_one_line_before_any_run(tmp_path, argv, message):
    status, printed, error = run_cli([*argv, "--output_dir", str(tmp_path / "out")])
    assert status == 2 and printed == ""
    assert error.count("\n") == 1 and error.startswith(f"kimi-k3-ablate: error: {message}")
    assert not (tmp_path / "out").exists()


def test_every_row_applies_to_the_default_and_the_quick_model_and_changes_it():
    for model in ({}, QUICK_MODEL):
        for row in ROWS.values():
            overrides = check_applies(row, model)
            assert row.flags or overrides or row.name == "baseline"
    finer = check_applies(ROWS["finer-experts"], {})
    assert finer == {"num_experts": 256, "num_experts_per_token": 16, "moe_intermediate_size": 32,
                     "num_shared_experts": 8}
    with pytest.raises(AblationError, match="row 'swiglu' cannot apply: the baseline config has a hidden_act other"):
        check_applies(ROWS["swiglu"], {"hidden_act": "silu"})


# -------------------------------------------------------------------------------------------------------- the report
def test_difference_is_flagged_only_beyond_twice_the_pooled_seed_spread():
    baseline = [1.0, 1.2]  # standard deviation 0.1414
    assert difference([1.3, 1.5], baseline, "{:.2f}") == "+0.30 **yes**"  # 0.30 > 2 x 0.1414
    assert difference([1.2, 1.4], baseline, "{:.2f}") == "+0.20 no"
    assert difference([0.5], [1.0], "{:.1f}") == "-0.5"  # one seed: no spread to compare with
    assert mean_and_std([1.0, 2.0, 3.0], "{:.2f}") == "2.00 ± 1.00"


def test_paired_difference_compares_the_per_seed_differences_with_their_own_spread():
    baseline = {0: 1.0, 1: 1.2, 2: 1.4}  # a seed spread of 0.2: unpaired, a shift of 0.1 is far inside it
    row = {0: 1.11, 1: 1.29, 2: 1.5, 3: 9.0}  # seed 3 has no baseline run and is left out
    assert difference(list(row.values())[:3], list(baseline.values()), "{:.2f}") == "+0.10 no"
    assert paired_difference(row, baseline, "{:.2f}") == "+0.10 ± 0.01 **yes**"  # d = 0.11, 0.09, 0.10
    assert paired_difference({0: 1.3, 1: 1.1}, {0: 1.0, 1: 1.2}, "{:.2f}") == "+0.10 ± 0.28 no"
    assert paired_difference({0: 1.5}, {0: 1.0}, "{:.1f}") == "+0.5"  # one common seed: no spread
    assert paired_difference({1: 1.5}, {0: 1.0}, "{:.1f}") == "no common seed"


def test_a_metric_a_run_could_not_measure_is_shown_as_such_and_compared_with_nothing():
    assert mean_and_std([math.nan, 1.0], "{:.2f}") == "n/a"
    assert difference([1.0, 2.0], [math.nan, 1.0], "{:.2f}") == "n/a"
    assert paired_difference({0: math.nan, 1: 2.0}, {0: 1.0, 1: 1.0}, "{:.2f}") == "n/a"


@pytest.mark.parametrize("row", [row for row in ROWS.values() if row.overrides or row.derive])
def test_every_model_row_measures_its_routed_experts_and_attention(row):
    """The evaluation pass finds the routed experts of every model a row builds (the shared-basis experts hold no fused
    weight parameters) and its MLA logits: a row's activation maxima are numbers, not gaps in the table."""
    config = KimiK3Config(**{**QUICK_MODEL, **check_applies(row, QUICK_MODEL)})
    model = causal_lm_class(config)(config).eval()
    input_ids = torch.randint(3, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    blocks = Dataset.from_dict({"input_ids": input_ids.tolist(), "labels": input_ids.tolist()})
    record = evaluation_record(model, blocks)
    assert all(math.isfinite(value) for value in record.values()), record
    assert record["max_expert_activation"] > 0 and record["max_attention_logit"] > 0


def test_a_matrix_trained_on_several_machines_says_so_with_the_runs_of_each():
    assert run_machines(["AMD EPYC, AVX2", "AMD EPYC, AVX2"]) == ["- the runs were trained on: AMD EPYC, AVX2"]
    lines = run_machines(["AMD EPYC, AVX2", "Xeon, AVX512", None, "AMD EPYC, AVX2"])
    assert lines[0].startswith("- the runs were trained on different machines")
    assert lines[1:] == ["  - 2 runs: AMD EPYC, AVX2", "  - 1 runs: Xeon, AVX512", "  - 1 runs: not recorded"]


def test_a_runs_machine_names_the_instruction_set_restrictions_it_ran_under(monkeypatch):
    """A CPU restricted to AVX2 runs AVX2 kernels but at its own speed: the record must tell it from a real AVX2 CPU."""
    for name in report.RESTRICTIONS:
        monkeypatch.delenv(name, raising=False)
    assert "(" not in report.run_machine().split("capability", 1)[1]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert f"capability {torch.backends.cpu.get_cpu_capability()} (ONEDNN_MAX_CPU_ISA=AVX2), " in report.run_machine()


def test_curves_average_over_seeds_at_the_steps_every_seed_logged():
    runs = [{"loss_curve": [[1, 4.0], [2, 3.0], [4, 1.0]]}, {"loss_curve": [[1, 2.0], [2, 5.0]]}]
    assert mean_curve(runs, "loss_curve") == [(1, 3.0), (2, 4.0)]


# ---------------------------------------------------------------------------------------------------------- end to end
def matrix_args(out: Path, corpus: Path) -> list[str]:
    """Baseline and the sign rule, one seed, 4 steps of the tests' tiny model, a checkpoint every 2 steps."""
    return ["--preset", "quick", "--rows", "sign-balancing", "--seeds", "0", "--max_steps", "4", "--output_dir",
            str(out), "--data_files", str(corpus), "--config_overrides", json.dumps(TINY_MODEL),
            "--job_args", "--save_steps 2 --logging_steps 1 --warmup_steps 0"]


def results(out: Path) -> dict[str, dict]:
    return {path.parent.name: json.loads(path.read_text()) for path in sorted(out.glob("runs/*/seed-0.json"))}


def kill_when(process: subprocess.Popen, ready: Path, timeout_s: float = HANG_CEILING_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        assert process.poll() is None and time.monotonic() < deadline, "the matrix ended before the checkpoint"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.slow
def test_matrix_writes_its_report_skips_finished_runs_and_resumes_a_killed_one_to_the_same_numbers(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(data.reference_topics()[:30]))
    out = tmp_path / "out"
    status, printed, _ = run_cli(matrix_args(out, corpus))
    assert status == 0, printed
    first = results(out)
    assert sorted(first) == ["baseline", "sign-balancing"]
    report = (out / "README.md").read_text()
    for name, result in first.items():
        metrics = result["metrics"]
        assert metrics["steps"] == 4 and [step for step, _ in metrics["loss_curve"]] == [1, 2, 3, 4]
        assert math.isfinite(metrics["eval_loss"]) and metrics["max_attention_logit"] > 0
        assert metrics["step_time_s"] > 0 and metrics["tokens_per_s"] > 0  # the job's clock timed its 4 steps
        assert f"| `{name}` |" in report and f"{metrics['eval_loss']:.4f}" in report
    assert first["baseline"]["metrics"]["total_parameters"] == first["sign-balancing"]["metrics"]["total_parameters"]
    assert first["baseline"]["metrics"]["max_vio_curve"] != first["sign-balancing"]["metrics"]["max_vio_curve"]
    assert "| `sign-balancing` | +" in report or "| `sign-balancing` | -" in report
    assert "| `sign-balancing` | 0 | +" in report or "| `sign-balancing` | 0 | -" in report  # paired by seed 0
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG" and (out / "max_vio_curves.png").is_file()
    capability = torch.backends.cpu.get_cpu_capability()
    assert f"capability {capability}" in first["baseline"]["machine"]  # the CPU kind its rounding came from
    assert f"- the runs were trained on: {first['baseline']['machine']}" in report
    assert "[1/2] baseline seed 0 done in" in printed and "1 left, about " in printed
    assert "[2/2] sign-balancing seed 0 done in" in printed and "all done" in printed
    bias_key = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    sign_bias = load_file(out / "runs" / "sign-balancing" / "seed-0" / "model" / "model.safetensors")[bias_key]
    steps = sign_bias.double() / 1e-3  # the row's flags reach the job: 4 moves of +-gamma each, in float32
    assert torch.allclose(steps, steps.round(), atol=1e-4) and 0 < steps.round().abs().max() <= 4

    logs = {path: path.read_bytes() for path in out.glob("runs/*/seed-0.*")}
    status, printed, _ = run_cli(matrix_args(out, corpus))
    assert status == 0 and "2 of 2 runs already finished, skipped" in printed and "training" not in printed
    assert {path: path.read_bytes() for path in out.glob("runs/*/seed-0.*")} == logs

    sign = out / "runs" / "sign-balancing"
    for path in sign.iterdir():
        subprocess.run(["rm", "-rf", str(path)], check=True)
    command = [sys.executable, "-m", "kimi_k3.ablation.cli", *matrix_args(out, corpus)]
    killed = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    kill_when(killed, sign / "seed-0" / "checkpoint-2")
    assert not (sign / "seed-0.json").exists()
    status, printed, _ = run_cli([*matrix_args(out, corpus), "--report_only"])
    report = (out / "README.md").read_text()
    assert status == 0 and "1 of 2 runs finished" in printed and "training" not in printed
    assert "| `baseline` |" in report and "| `sign-balancing` |" not in report
    assert "Runs not finished (the same command without --report_only trains them): sign-balancing seed 0." in report
    status, printed, _ = run_cli(matrix_args(out, corpus))
    assert status == 0 and "[2/2] sign-balancing seed 0: resuming from checkpoint-2" in printed
    resumed = results(out)["sign-balancing"]["metrics"]
    expected = first["sign-balancing"]["metrics"]
    for key in ("loss_curve", "max_vio_curve", "eval_loss", "max_expert_activation", "max_attention_logit"):
        assert resumed[key] == expected[key], key  # the job is deterministic on CPU, and resumes bit for bit
    assert resumed["resumed_at"] == [2]
