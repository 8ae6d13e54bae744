"""The parallelism plan: its exact counts against the real sharding (meta device under a fake process group, and a
2-process gloo run), its communication volumes against what Newton–Schulz and Quantile Balancing send, its refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.planning import plan as parallel_plan
from kimi_k3.planning.model_inventory import build_model, model_inventory
from kimi_k3.planning.plan import (
    NEWTON_SCHULZ_ROW,
    QUANTILE_BALANCING_ROW,
    Layout,
    PlanError,
    Setup,
    element_counts,
    make_plan,
    search,
)
from kimi_k3.planning.verify import differences, fake_process_group, shard, sharded_run
from modeling_kimi_k3 import KimiK3ForCausalLM
from kimi_k3.planning import cli as plan_parallel
from tests.conftest import HANG_CEILING_S

ROOT = Path(__file__).resolve().parents[2]
COUNT_SCRIPT = ROOT / "tests" / "dist_scripts" / "plan_counts.py"
LAUNCH_TIMEOUT_S = HANG_CEILING_S


@pytest.fixture(scope="module")
def config():
    """The default (small) config: 9 layers, 64 experts; KDA b_proj has 4 rows."""
    return KimiK3Config()


def plan_row(plan, name):
    return next(row for row in plan.communication if row[0] == name)


# ---------------------------------------------------------------------------------------------------------------------
# Plan counts against the real sharding on the meta device
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "setup", "path"),
    [
        (Layout(3, 3), Setup(), "accelerate"),  # pure FSDP, 64 experts and most rows uneven over 3 ranks
        (Layout(2, 2), Setup(), "transformers"),  # load-time FSDP2 without experts split
        (Layout(4, 4, ep=2), Setup(), "transformers"),  # EP + FSDP: 32 experts per ep rank, sharded over 2
        (Layout(6, 6), Setup(optimizer="adamw"), "accelerate"),  # 64 experts over 6 ranks: rank 0 keeps 11
        (Layout(2, 2), Setup(optimizer="adamw", lora_rank=4), "accelerate"),  # frozen base, peft adapters
    ],
    ids=["fsdp3", "fsdp2-transformers", "ep2-fsdp4", "fsdp6-adamw", "lora-fsdp2"],
)
def test_plan_counts_equal_the_meta_model_sharded_by_the_real_code(config, layout, setup, path):
    """Counts, every placement, the optimizer step's collectives and Newton–Schulz's assignment."""
    plan = make_plan(config, layout, setup)
    run = sharded_run(config, layout, setup, path)
    assert differences(plan, run) == []
    assert run.sent.calls == [] if setup.optimizer == "adamw" else len(run.sent.calls) == 2


def test_uneven_expert_split_keeps_ceil_rows_on_rank_0(config):
    counts = element_counts(config, Layout(6, 6), Setup(optimizer="adamw"))
    gate_up = parallel_plan.ParamSpec("experts.gate_up_proj", (64, 256, 128), "layers.1", "muon", expert=True)
    assert parallel_plan.local_numel(gate_up, Layout(6, 6)) == 11 * 256 * 128
    assert counts.parameters > sum(s.numel for s in model_inventory(config).specs) // 6


def test_expert_parallel_size_that_does_not_divide_the_experts_is_refused_like_the_sharding_code(config):
    layout = Layout(6, 6, ep=3)
    with pytest.raises(PlanError, match=r"`ep` \(3\) must divide the 64 experts"):
        make_plan(config, layout, Setup())
    with fake_process_group(6), pytest.raises(ValueError, match="Cannot evenly shard 64 experts"):
        shard(build_model(config, "meta"), layout, "transformers")


def test_muon_trains_experts_sharded_over_more_ranks_than_there_are_experts(config):
    """64 experts over 128 ranks with ep 2: 32 per ep rank over 64 FSDP ranks, so half of the ranks hold none. Every
    expert block stays on its rank, and each rank adds its own rows to its shard."""
    layout = Layout(128, 128, ep=2)
    plan = make_plan(config, layout, Setup())
    assert differences(plan, sharded_run(config, layout, Setup())) == []
    experts = [i for i, spec in enumerate(model_inventory(config).muon_step_order) if spec.expert]
    assert experts and all(param not in experts for param, _, _ in plan.newton_schulz.cut)


def test_split_newton_schulz_runs_muon_on_matrices_with_fewer_rows_than_ranks(config):
    """b_proj has 4 rows, sharded over 5 ranks: split Newton–Schulz adds each rank's rows to its shard in place."""
    plan = make_plan(config, Layout(5, 5), Setup())
    run = sharded_run(config, Layout(5, 5), Setup(), "accelerate")
    assert differences(plan, run) == [] and run.sent.payload > 0


def test_search_finds_the_smallest_world_size_that_fits(config):
    setup = Setup(optimizer="adamw", sequence_length=256, gpu_memory_gb=0.4, reserved_gb=0.0)
    plan, _ = search(config, setup, max_world_size=16, step=1)
    assert plan.fits and plan.layout.world_size > 1
    smaller = parallel_plan.candidate_layouts(config, plan.layout.world_size - 1, setup)
    assert not any(make_plan(config, layout, setup).fits for layout in smaller)


def test_activation_estimate_is_within_15_percent_of_what_autograd_saves(config):
    """Default config, fp32, one 256-token sequence, no checkpointing: the bytes of the distinct tensors saved for
    backward (parameters excluded) against the plan's estimate."""
    model = KimiK3ForCausalLM(config).train()
    input_ids = torch.randint(config.vocab_size, (1, 256))
    saved = {}

    def record(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        model(input_ids=input_ids, labels=input_ids)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(size for pointer, size in saved.items() if pointer not in weights)
    estimate = parallel_plan.activations(config, Setup(sequence_length=256), 4, checkpointing=False)
    assert 0.85 < estimate / measured < 1.15


# ---------------------------------------------------------------------------------------------------------------------
# The script: verification, fit verdicts, bad input
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_full_k3_with_per_head_muon_fits_448_h200s_and_is_verified_there(capsys):
    """The released model with bf16 weights at the layout AdamW needs (448 ranks, ep 28): 2 whole experts per rank,
    whose Newton–Schulz never leaves it."""
    assert plan_parallel.main(["--world_size", "448", "--ep", "28", "--param_dtype", "bf16", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified: parameters, gradients, optimizer state and buffers" in out
    assert "fits: " in out and "memory per rank (rank 0)" in out and "expert all-to-all" in out
    assert NEWTON_SCHULZ_ROW in out


def test_small_config_fits_and_prints_both_tables(capsys):
    assert plan_parallel.main(["--config", "small", "--world_size", "2", "--block_size", "64"]) == 0
    out = capsys.readouterr().out
    assert "fits: " in out and "communication per step per rank" in out
    assert QUANTILE_BALANCING_ROW in out and NEWTON_SCHULZ_ROW in out


def test_a_plan_that_disagrees_with_the_sharded_model_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr(parallel_plan, "local_numel", lambda spec, layout: spec.numel // layout.fsdp)
    assert plan_parallel.main(["--config", "small", "--world_size", "3", "--optimizer", "adamw", "--verify"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_a_plan_that_places_the_experts_wrongly_is_an_error_naming_the_parameter(monkeypatch, capsys):
    """Experts taken as plain FSDP2 shards under ep 2: the plan's placements are not the sharded model's."""
    one_dim = parallel_plan.planned_placements
    monkeypatch.setattr(parallel_plan, "planned_placements",
                        lambda expert, layout: one_dim(expert, Layout(layout.world_size, layout.fsdp)))
    assert plan_parallel.main(["--config", "small", "--world_size", "4", "--ep", "2", "--verify"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "experts.gate_up_proj: plan places it ((4,)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world_size", "64", "--fsdp", "32"], "fsdp (32) x tp (1) = 32 ranks, but `world_size` is 64"),
        (["--world_size", "256", "--ep", "256"], "`ep` (256) must divide the 896 experts"),
        (["--world_size", "64", "--ep", "128"], "`ep` (128) must divide `fsdp` (64)"),
        (["--world_size", "16", "--tp", "2"], "`tp` must be 1"),
        (["--world_size", "8", "--gradient_accumulation_steps", "0"],
         "`gradient_accumulation` must be a positive integer"),
        (["--world_size", "8", "--lora_rank", "8"], "use `optimizer` 'adamw' with LoRA"),
        (["--world_size", "8", "--param_dtype", "fp32", "--per_device_train_batch_size", "0"],
         "`micro_batch` must be a positive"),
    ],
)
def test_bad_layouts_get_one_line_before_anything_is_instantiated(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(KimiK3ForCausalLM, "__init__", lambda *args, **kwargs: pytest.fail("model instantiated"))
    assert plan_parallel.main([*argv, "--verify"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_planner_takes_the_training_jobs_option_spellings(capsys):
    options = ["--config", "small", "--world_size", "2", "--block_size", "64", "--per_device_train_batch_size", "2",
               "--gradient_checkpointing", "false", "--muon_ns_dtype", "float32", "--qk_clip_tau", "none",
               "--optimizer", "per_head_muon", "--qat", "mxfp4"]
    assert plan_parallel.main(options) == 0
    planned = capsys.readouterr()
    assert planned.err == "" and "checkpointing off" in planned.out and "MXFP4 QAT" in planned.out


def test_config_the_model_refuses_gets_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "num_experts_per_token": 0}))
    assert plan_parallel.main(["--config", str(tmp_path), "--world_size", "2"]) == 2
    err = capsys.readouterr().err
    assert "num_experts_per_token" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------------------------------
# A real 2-process gloo run
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_process_counts(tmp_path_factory, config):
    work = tmp_path_factory.mktemp("plan_counts")
    torch.manual_seed(0)
    KimiK3ForCausalLM(config).save_pretrained(work / "initial")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(COUNT_SCRIPT), str(work)]
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath},
                            capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    if result.returncode:
        pytest.fail(f"the 2-process run failed:\n{(result.stdout + result.stderr)[-6000:]}")
    return json.loads((work / "counts.json").read_text())


@pytest.mark.distributed
@pytest.mark.parametrize(("run", "layout"), [("fsdp", Layout(2, 2)), ("expert_parallel", Layout(2, 2, ep=2))])
def test_plan_equals_what_a_real_two_process_run_holds_and_sends(two_process_counts, config, run, layout):
    measured = two_process_counts[run]
    plan = make_plan(config, layout, Setup(sequence_length=16))
    assert measured["counts"] == vars(plan.counts)
    assert (measured["newton_schulz"]["calls"], measured["newton_schulz"]["payload"]) == plan.newton_schulz_traffic
    _, _, calls, payload, _ = plan_row(plan, QUANTILE_BALANCING_ROW)
    assert (measured["quantile_balancing"]["calls"], measured["quantile_balancing"]["payload"]) == (calls, payload)
    # 9 layers - 1 dense = 8 MoE layers of 64 token counts and 64 x 1000 histogram bins, int64.
    assert payload == 8 * 64 * 1001 * 8


# ---------------------------------------------------------------------------------------------------------------------
# The opt-in Stable LatentMoE variants
# ---------------------------------------------------------------------------------------------------------------------
VARIANT_CONFIGS = {
    "basis+quantile+gate": {"expert_basis_size": 16, "router_score_normalization": "quantile",
                            "attention_gate_routing": True},
    "two-level": {"num_coarse_experts": 8, "coarse_experts_per_token": 2},
    "dynamic-k": {"dynamic_experts_per_token": True},
}


@pytest.mark.parametrize("variant", VARIANT_CONFIGS)
def test_plan_counts_of_the_variants_equal_the_meta_model_sharded_by_the_real_code(variant):
    config = KimiK3Config(**VARIANT_CONFIGS[variant])
    layout, setup = Layout(2, 2), Setup()
    plan = make_plan(config, layout, setup)
    assert differences(plan, sharded_run(config, layout, setup, "accelerate")) == []


def test_full_size_shared_basis_parameters_follow_the_formula_and_expert_parallelism_is_refused():
    released, basis = KimiK3Config.kimi_k3(), KimiK3Config.kimi_k3(expert_basis_size=224)
    total = {name: sum(spec.numel for spec in model_inventory(c).specs) for name, c in (("released", released),
                                                                                      ("basis", basis))}
    experts, expert_size, moe_layers = 896, 3 * 3072 * 3584, 92
    assert total["released"] - total["basis"] == moe_layers * (experts * expert_size - (224 * expert_size + 2 * experts * 224))
    with pytest.raises(PlanError, match="`ep` must be 1 with shared-basis experts"):
        make_plan(basis, Layout(64, 64, ep=8), Setup())
