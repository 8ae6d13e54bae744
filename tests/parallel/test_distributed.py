"""Multi-process training: DDP through Trainer/accelerate, FSDP2 (raw loop, and Trainer on models sharded at load
time, with and without expert parallelism), Quantile Balancing statistics, checkpoints across world sizes.

One ``accelerate launch`` of ``tests/dist_scripts/k3_scenarios.py`` on 2 CPU processes (gloo) runs every
distributed scenario; each test compares one of its results with a single-process run in this process.

The single-process references see the same global batch split into the same micro-batches and accumulate their
gradients (``gradient_accumulation_steps=2``), so each micro-batch gradient g_i is computed on the same shapes in
both runs. Trainer divides a micro-batch's label sum by the label count of the whole global batch; under DDP it
also multiplies the loss by the world size, which DDP's gradient average divides out again: 2·g0/2 + 2·g1/2 is
bitwise the accumulated g0 + g1, because powers of two scale exactly. So losses, every step's router bias and the
final weights agree bitwise, even through Newton–Schulz in bf16, which turns any summation-order difference into a
visible one (see the whole-batch and expert-parallel tests)."""

import os
import socket
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from accelerate.utils.launch import prepare_multi_gpu_env

from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import HANG_CEILING_S, run_processes, tiny_config
from tests.dist_scripts import k3_scenarios as scenarios
from tests.job.test_train import tiny_args, write_corpus
from tests.numerics import assert_within_rounding_spread, perturb_parameters

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
DDP_CONFIG = ROOT / "configs" / "accelerate_ddp.yaml"
FSDP2_CONFIG = ROOT / "configs" / "accelerate_fsdp2.yaml"
LAUNCH_TIMEOUT_S = HANG_CEILING_S
LAST_STEP = f"checkpoint-{scenarios.STEPS}"
RESUME_STEP = f"checkpoint-{scenarios.SAVE_STEPS}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_processes(work: Path, ns_dtype: str) -> None:
    """``accelerate launch`` with the repository's DDP config; fails the test with the output tail on error."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG),
        "--num_processes", str(scenarios.WORLD_SIZE), "--main_process_port", str(free_port()),
        str(Path(scenarios.__file__)), str(work), ns_dtype,
    ]
    run_processes(command, LAUNCH_TIMEOUT_S)


def assert_same_state(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.fixture(scope="module")
def config():
    # Three MLA heads over two ranks: a shard boundary cuts through head 1 of q_b_proj and kv_b_proj.
    return tiny_config(num_attention_heads=3)


# Newton–Schulz in bf16 is what "auto" picks on CPUs with native bf16 and on GPUs, fp32 elsewhere: both are forced, so
# every CPU checks the bitwise promises of both.
@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def ns_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def work(tmp_path_factory, config, ns_dtype):
    work = tmp_path_factory.mktemp(f"distributed_{ns_dtype}")
    config.to_json_file(work / "config.json")
    scenarios.build_model(config).save_pretrained(work / "initial")
    return work


@pytest.fixture(scope="module")
def single_process(work, config, ns_dtype):
    """The Trainer reference: 2 accumulated micro-batches per step; its checkpoints seed the 2-process resume."""
    return scenarios.train_with_trainer(config, work / "single", ns_dtype=ns_dtype, gradient_accumulation_steps=2)


@pytest.fixture(scope="module")
def single_process_unclipped(work, config, ns_dtype):
    """The reference of the runs on models sharded at load time, which clip no gradient."""
    return scenarios.train_with_trainer(
        config, work / "single_unclipped", ns_dtype=ns_dtype, gradient_accumulation_steps=2, save_steps=None,
        max_grad_norm=0,
    )


def perturbed_run(config, output_dir, ns_dtype, **settings) -> dict:
    """A single-process run from the initial weights perturbed by one fp32 rounding: how far rounding-level
    differences carry through these steps, on this CPU (see tests/numerics.py)."""
    model = perturb_parameters(scenarios.build_model(config), seed=1)
    return scenarios.train_with_trainer(config, output_dir, ns_dtype=ns_dtype, gradient_accumulation_steps=2,
                                        model=model, save_steps=None, **settings)


@pytest.fixture(scope="module")
def single_process_perturbed(work, config, ns_dtype):
    return perturbed_run(config, work / "single_perturbed", ns_dtype)


@pytest.fixture(scope="module")
def single_process_unclipped_perturbed(work, config, ns_dtype):
    return perturbed_run(config, work / "single_unclipped_perturbed", ns_dtype, max_grad_norm=0)


def assert_same_trajectory_up_to_rounding(actual: dict, reference: dict, perturbed: dict) -> None:
    """Every step's loss and router biases of ``actual`` within the rounding spread of ``reference``'s."""
    for key in ("losses", "biases"):
        assert_within_rounding_spread(torch.as_tensor(actual[key]), torch.as_tensor(reference[key]),
                                      torch.as_tensor(perturbed[key]), what=key)


@pytest.fixture(scope="module")
def two_processes(work, single_process, ns_dtype):
    launch_two_processes(work, ns_dtype)
    return torch.load(work / "distributed.pt", weights_only=False)


# ---------------------------------------------------------------------------------------------------------------------
# accelerate configs
# ---------------------------------------------------------------------------------------------------------------------
def launch_environment(config_file: Path) -> tuple:
    """What ``accelerate launch --config_file`` resolves: the launch arguments and the workers' environment."""
    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, _, _ = _validate_launch_command(args)
    return args, prepare_multi_gpu_env(args)


def test_ddp_config_launches_several_processes_not_the_single_process_cpu_launcher():
    args, env = launch_environment(DDP_CONFIG)
    assert args.multi_gpu and not args.cpu and not args.use_fsdp
    assert args.num_processes == scenarios.WORLD_SIZE
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"


def test_fsdp2_config_shards_each_decoder_layer(config):
    args, env = launch_environment(FSDP2_CONFIG)
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert args.use_fsdp and plugin.fsdp_version == 2
    model = KimiK3ForCausalLM(config)
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [name for name, module in model.named_modules() if policy(module)]
    assert wrapped == [f"model.layers.{i}" for i in range(config.num_hidden_layers)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs accelerate runs the FSDP2 config as FSDP2")
def test_fsdp2_config_on_cpu_says_in_one_line_that_ddp_runs_and_the_card_records_parallelism_and_autocast(tmp_path):
    args = tiny_args(tmp_path / "run", write_corpus(tmp_path), "--max_steps", "1", "--eval_strategy", "no",
                     "--use_cpu", "True", "--no_fused_situ")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP2_CONFIG),
        "--num_processes", str(scenarios.WORLD_SIZE), "--main_process_port", str(free_port()),
        "-m", "kimi_k3.job", *args,
    ]
    output = run_processes(command, LAUNCH_TIMEOUT_S)
    runs = f"DDP over {scenarios.WORLD_SIZE} CPU processes (gloo), each holding the whole model"
    assert [line for line in output.splitlines() if "FSDP" in line] == [
        f"kimi-k3-train: warning: the accelerate config asks for FSDP, which accelerate runs on GPUs only: this run "
        f"trains with {runs}, under bf16 autocast"
    ]
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert f"| parallelism | {runs} |" in card and "| autocast | bf16 autocast |" in card


# ---------------------------------------------------------------------------------------------------------------------
# DDP through Trainer
# ---------------------------------------------------------------------------------------------------------------------
def test_ddp_trainer_runs_two_processes_whose_router_bias_agrees_after_every_step(two_processes):
    ddp = two_processes["ddp"]
    assert ddp["world_size"] == scenarios.WORLD_SIZE
    # Each rank all-gathered its bias after every step and raised on any difference (StepRecorder).
    assert ddp["biases"].shape[0] == scenarios.STEPS
    assert ddp["biases"].abs().amax(-1).min() > 0


def test_ddp_trainer_equals_single_process_accumulating_the_same_global_batch(two_processes, single_process, config):
    ddp = two_processes["ddp"]
    # QK-Clip was active and selective, so its MAX reduction over ranks mattered.
    maxima = single_process["logit_maxima"]
    assert (maxima > scenarios.QK_CLIP_TAU).any() and (maxima < scenarios.QK_CLIP_TAU).any()
    assert ddp["losses"] == single_process["losses"]
    assert torch.equal(ddp["biases"], single_process["biases"])
    assert_same_state(ddp["state"], single_process["state"])
    initial = scenarios.build_model(config).state_dict()
    moved = [name for name, tensor in initial.items() if not torch.equal(tensor, ddp["state"][name])]
    assert "model.layers.0.self_attn.q_proj.weight" in moved and "lm_head.weight" in moved


def test_ddp_trainer_matches_single_process_with_the_whole_global_batch_per_step(
    two_processes, work, config, ns_dtype, single_process_perturbed
):
    """One batch of 2B sequences instead of 2 x B: the same gradient up to summation order, which bf16 NS amplifies.

    DDP equals the accumulating single process bitwise (above), so the perturbed single process bounds it."""
    whole = scenarios.train_with_trainer(
        config, work / "whole_batch", ns_dtype=ns_dtype, gradient_accumulation_steps=1,
        micro_batch=scenarios.GLOBAL_BATCH,
    )
    assert_same_trajectory_up_to_rounding(whole, two_processes["ddp"], single_process_perturbed)


# ---------------------------------------------------------------------------------------------------------------------
# Quantile Balancing statistics
# ---------------------------------------------------------------------------------------------------------------------
def test_quantile_balancing_pools_histograms_over_ranks_and_micro_batches_bit_identically(two_processes, config):
    # Two micro-batches per rank in the 2-process run; all four, one after the other, here.
    batches = [batch for step in scenarios.micro_batches(config)[:2] for batch in step]
    single = scenarios.pooled_histograms_and_bias(config, batches)
    pooled = two_processes["balancing"]
    assert torch.equal(pooled["pooled"], single["pooled"])
    assert torch.equal(pooled["bias"], single["bias"])
    # Rank 0 alone counted half of the tokens.
    assert 2 * pooled["local"].sum() == single["pooled"].sum()
    assert not torch.equal(pooled["local"], single["local"])


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2 (raw loop: accelerate turns FSDP on CPU processes into DDP)
# ---------------------------------------------------------------------------------------------------------------------
def test_fsdp2_shards_every_parameter_along_its_rows_through_head_blocks(two_processes, config):
    """Rank 0 holds the first ceil(rows / 2) rows of every parameter (torch.chunk along dim 0)."""
    shapes = two_processes["fsdp"]["local_and_full_shapes"]
    for name, (local, full) in shapes.items():
        assert local == (-(-full[0] // scenarios.WORLD_SIZE), *full[1:]), name
    # So Per-Head Muon and QK-Clip find part of a head on each rank.
    mla = f"model.layers.{config.mla_layer_indices[0]}.self_attn"
    assert shapes[f"{mla}.q_b_proj.weight"][0][0] % (config.qk_nope_head_dim + config.qk_rope_head_dim)
    assert shapes[f"{mla}.kv_b_proj.weight"][0][0] % (config.qk_nope_head_dim + config.v_head_dim)


def test_fsdp2_training_with_per_head_muon_qk_clip_and_quantile_balancing_equals_single_process(
    two_processes, config, ns_dtype
):
    single = scenarios.train_single_process_raw(config, ns_dtype)
    fsdp = two_processes["fsdp"]
    assert fsdp["losses"] == single["losses"]
    assert torch.equal(fsdp["biases"], single["biases"])
    assert_same_state(fsdp["state"], single["state"])


def test_fsdp2_model_saved_from_two_processes_loads_in_one(two_processes, work):
    loaded = KimiK3ForCausalLM.from_pretrained(work / "fsdp_model")
    assert_same_state(loaded.state_dict(), two_processes["fsdp"]["state"])


# ---------------------------------------------------------------------------------------------------------------------
# Trainer on models sharded by transformers at load time (DistributedConfig), which works on CPU processes too
# ---------------------------------------------------------------------------------------------------------------------
def test_trainer_on_model_sharded_at_load_time_equals_single_process(
    two_processes, single_process_unclipped, single_process_unclipped_perturbed
):
    """Per-Head Muon from the plain factory and QK-Clip, both on the DTensor shards, bit for bit.

    Both runs clip no gradient. The global gradient norm of the sharded model is summed from each rank's shard of
    each gradient, in another order than whole tensors in one process: with clipping (max_grad_norm=1), the
    gradients of step 3 agreed bitwise before clipping but their norms did not (1.6228077 against 1.6228076, one
    fp32 ulp), so the clip factor scaled every gradient one ulp apart, and bf16 Newton-Schulz carried that to 3e-4 in
    the final weights. Without clipping the norm is still computed, and only it differs. (Gradient elements below
    the normal range, 1e-44 in one KDA layer's decay gate, can differ by a subnormal step: scaling the loss by the
    world size and averaging over ranks is exact for normal floats only. No update sees them.)"""
    sharded, single = two_processes["sharded_at_load"], single_process_unclipped
    assert sharded["world_size"] == scenarios.WORLD_SIZE
    assert sharded["losses"] == single["losses"]
    assert torch.equal(sharded["biases"], single["biases"])
    assert_same_state(sharded["state"], single["state"])
    assert_within_rounding_spread(torch.tensor(sharded["grad_norms"]), torch.tensor(single["grad_norms"]),
                                  torch.tensor(single_process_unclipped_perturbed["grad_norms"]), what="grad_norms")


def test_expert_parallel_trainer_matches_single_process_up_to_summation_order(
    two_processes, single_process_unclipped, single_process_unclipped_perturbed, config
):
    """Experts split over the ranks: tokens travel by all-to-all and expert outputs are combined in another order."""
    expert_parallel = two_processes["expert_parallel"]
    assert expert_parallel["local_experts"] == config.num_experts // scenarios.WORLD_SIZE
    assert_same_trajectory_up_to_rounding(expert_parallel, single_process_unclipped, single_process_unclipped_perturbed)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints across world sizes
# ---------------------------------------------------------------------------------------------------------------------
def test_single_process_checkpoint_resumes_in_two_processes(two_processes, single_process):
    resumed = two_processes["ddp_resumed"]
    assert resumed["losses"] == single_process["losses"][scenarios.SAVE_STEPS:]
    assert torch.equal(resumed["biases"], single_process["biases"][scenarios.SAVE_STEPS:])
    assert_same_state(resumed["state"], single_process["state"])


def test_single_process_checkpoint_loads_into_fsdp2_sharded_model(two_processes, work):
    expected = KimiK3ForCausalLM.from_pretrained(work / "single" / LAST_STEP).state_dict()
    assert_same_state(two_processes["fsdp_loaded"], expected)


def test_single_process_checkpoint_loads_through_trainer_into_model_sharded_at_load_time(two_processes, work):
    expected = KimiK3ForCausalLM.from_pretrained(work / "single" / LAST_STEP).state_dict()
    assert_same_state(two_processes["sharded_loaded"], expected)


def test_two_process_checkpoint_loads_and_resumes_in_one_process(two_processes, work, config, ns_dtype):
    ddp = two_processes["ddp"]
    loaded = KimiK3ForCausalLM.from_pretrained(work / "ddp" / LAST_STEP)
    assert_same_state(loaded.state_dict(), ddp["state"])
    resumed = scenarios.train_with_trainer(
        config, work / "single_resumed", ns_dtype=ns_dtype, gradient_accumulation_steps=2,
        resume_from_checkpoint=str(work / "ddp" / RESUME_STEP),
    )
    assert resumed["losses"] == ddp["losses"][scenarios.SAVE_STEPS:]
    assert_same_state(resumed["state"], ddp["state"])


# ---------------------------------------------------------------------------------------------------------------------
# MXFP4 quantization-aware training (kimi_k3.quantization.qat) under DDP and FSDP2
# ---------------------------------------------------------------------------------------------------------------------
def test_qat_under_ddp_equals_single_process(two_processes, work, config, ns_dtype):
    single = scenarios.train_with_trainer(
        scenarios.qat_config(config), work / "single_qat", ns_dtype=ns_dtype, gradient_accumulation_steps=2,
        model=scenarios.build_qat_model(config), save_steps=None,
    )
    assert two_processes["ddp_qat"]["losses"] == single["losses"]
    assert_same_state(two_processes["ddp_qat"]["state"], single["state"])


def test_qat_under_fsdp2_equals_single_process(two_processes, config, ns_dtype):
    """Bitwise with bf16 Newton–Schulz. With fp32 Newton–Schulz, forced on a CPU whose "auto" is bf16, the third
    step's loss once differed from the single process's by one fp32 ulp (4.596795082 against 4.596794605): the QAT
    model's shapes without ``attach_qat`` train bitwise under FSDP2 in fp32, so the difference enters through the
    fake-quantized experts under FSDP2, and bf16 Newton–Schulz rounds it away. Until it is found, the fp32 run is held
    to the rounding spread of a single process started from weights perturbed by one rounding."""
    qat = scenarios.qat_config(config)
    raw = scenarios.train_single_process_raw(qat, ns_dtype, model=scenarios.build_qat_model(config))
    fsdp = two_processes["fsdp_qat"]
    if ns_dtype == "float32":
        perturbed_model = perturb_parameters(scenarios.build_qat_model(config), seed=1)
        perturbed = scenarios.train_single_process_raw(qat, ns_dtype, model=perturbed_model)
        assert_same_trajectory_up_to_rounding(fsdp, raw, perturbed)
    else:
        assert fsdp["losses"] == raw["losses"]
        assert_same_state(fsdp["state"], raw["state"])
    plain = scenarios.train_single_process_raw(qat, ns_dtype)
    assert plain["losses"] != raw["losses"]  # the QAT forward differs from the plain one
