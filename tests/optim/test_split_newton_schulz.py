"""Newton–Schulz split across ranks: the block plan in this process, and 2 gloo processes against one.

The launched run (``tests/dist_scripts/split_newton_schulz.py``) steps the default ``KimiK3Config()`` model (and a tiny
one with mixed block shapes), replicated as under DDP and FSDP2-sharded, on gradients that depend only on the parameter
name and step; the test repeats the steps in this process with the same gradients."""

from pathlib import Path

import pytest
import torch

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.optim.muon import NS_STEPS, build_param_groups, muon_shapes_and_patterns, newton_schulz_exchange_bytes
from kimi_k3.optim.split_newton_schulz import (
    Block,
    assign_blocks,
    chunk_row_ranges,
    exchange_bytes,
    newton_schulz_flops,
    plan_exchange,
    row_blocks,
    sharded_exchange_bytes,
)
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config, torchrun
from tests.dist_scripts import split_newton_schulz as scenario

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 900


def default_model_muon_shapes():
    with torch.device("meta"):
        model = KimiK3ForCausalLM(KimiK3Config())
    return muon_shapes_and_patterns(build_param_groups(model))


# ---------------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------------
def test_row_blocks_tile_heads_experts_and_whole_matrices():
    assert row_blocks(0, torch.Size([6, 4]), (2, 1)) == [
        Block(0, 0, 2, 4), Block(0, 2, 1, 4), Block(0, 3, 2, 4), Block(0, 5, 1, 4)
    ]
    assert [(b.start, b.rows) for b in row_blocks(1, torch.Size([3, 8, 5]), (4,))] == [(i * 4, 4) for i in range(6)]
    assert row_blocks(2, torch.Size([7, 3]), None) == [Block(2, 0, 7, 3)]


@pytest.mark.parametrize("shape", [(10, 3), (9, 4, 2), (1, 5), (3, 2, 2)])
def test_chunk_row_ranges_are_the_rows_torch_chunk_gives_each_rank(shape):
    rows = torch.arange(torch.Size(shape).numel()).view(shape)
    chunks = rows.chunk(4)
    for rank, (lo, hi) in enumerate(chunk_row_ranges(torch.Size(shape), 4)):
        expected = chunks[rank].reshape(-1, shape[-1]) if rank < len(chunks) else rows[:0].reshape(-1, shape[-1])
        assert torch.equal(rows.reshape(-1, shape[-1])[lo:hi], expected)


def test_newton_schulz_flops_count_the_three_products_of_every_step():
    # 16 x 64: X Xᵀ and (...) X are 2·16²·64 each, (X Xᵀ)² is 2·16³; the orientation does not matter.
    assert newton_schulz_flops(16, 64, 5) == newton_schulz_flops(64, 16, 5) == 5 * (4 * 16 * 16 * 64 + 2 * 16**3)


def test_assignment_keeps_whole_blocks_home_and_balances_the_rest_largest_first():
    flops = [5, 5, 9, 1, 4, 3]
    homes = [0, 0, None, None, None, 1]
    assert assign_blocks(flops, homes, 2) == [0, 0, 1, 1, 0, 1]  # loads 10 + 4 = 14 and 3 + 9 + 1 = 13


def test_default_model_blocks_split_evenly_by_flops_in_both_layouts():
    shapes, patterns = default_model_muon_shapes()
    for sharded in (False, True):
        plan = plan_exchange(shapes, patterns, WORLD_SIZE, sharded, NS_STEPS)
        loads = plan.flops_per_rank(NS_STEPS)
        assert len(plan.blocks) == 1737 and sum(loads) == pytest.approx(117.0e9, rel=1e-3)
        assert max(loads) / min(loads) < 1.01
        assert plan_exchange(shapes, patterns, WORLD_SIZE, sharded, NS_STEPS).owners == plan.owners


def test_exchange_bytes_of_replicated_and_row_sharded_parameters():
    shapes, patterns = [(8, 4), (4, 2, 3)], [(2,), (2,)]  # 4 blocks of 2x4, then 4 blocks of 2x3 (2 experts)
    replicated = newton_schulz_exchange_bytes(shapes, patterns, 2, sharded=False, itemsize=2)
    # Each rank owns 4 blocks: two 2x4 and two 2x3 (largest first, alternating), 28 elements; all-gather (N-1)·28·2.
    assert replicated == [(56, 56), (56, 56)]
    # Row-sharded: every block lies inside one rank's rows, so nothing travels.
    assert newton_schulz_exchange_bytes(shapes, patterns, 2, sharded=True, itemsize=2) == [(0, 0), (0, 0)]
    # One 3x4 whole matrix over 2 ranks: rows 0-1 on rank 0 (its owner), row 2 on rank 1, sent there and back.
    assert newton_schulz_exchange_bytes([(3, 4)], [None], 2, sharded=True, itemsize=4) == [(16, 16), (16, 16)]


# ---------------------------------------------------------------------------------------------------------------------
# 2 processes against one
# ---------------------------------------------------------------------------------------------------------------------
def configs() -> dict[str, KimiK3Config]:
    """The default model, and a tiny one whose kv_b_proj has K and V blocks of different shapes (two RMS scales in
    one parameter) and whose 3 MLA heads put a shard boundary inside a head."""
    return {"default": KimiK3Config(), "mixed_blocks": tiny_config(num_attention_heads=3, v_head_dim=4)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    work = tmp_path_factory.mktemp("split_newton_schulz")
    for name, config in configs().items():
        config.to_json_file(work / f"{name}.json")
    torchrun(str(Path(scenario.__file__)), str(work), nproc=WORLD_SIZE, timeout_s=LAUNCH_TIMEOUT_S)
    return torch.load(work / "split.pt", weights_only=False)


@pytest.fixture(scope="module")
def single_process():
    return {name: scenario.single_process(config) for name, config in configs().items()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
@pytest.mark.parametrize("config", ["default", "mixed_blocks"])
def test_split_newton_schulz_is_bitwise_the_single_process_update_over_steps_with_momentum(
    config, layout, launched, single_process
):
    result, expected_state = launched[config][layout], single_process[config]["state"]
    assert result["state"].keys() == expected_state.keys()
    for name, expected in expected_state.items():
        assert torch.equal(result["state"][name], expected), name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_each_rank_does_half_the_newton_schulz_flops(layout, launched, single_process):
    """Counted by torch's FlopCounterMode around every optimizer step, on each rank and in the single process."""
    per_rank = torch.tensor(launched["default"][layout]["flops_per_rank"], dtype=torch.float64)  # [ranks, steps]
    total = torch.tensor(single_process["default"]["flops"], dtype=torch.float64)
    assert total.min() > 100e9  # the default model's 117 GFLOP of Newton–Schulz
    assert torch.all((per_rank / (total / WORLD_SIZE) - 1).abs() < 0.10)
    torch.testing.assert_close(per_rank.sum(0), total, rtol=1e-3, atol=0)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_measured_traffic_is_the_exchange_bytes_formula(layout, launched):
    shapes, patterns = default_model_muon_shapes()
    result = launched["default"][layout]
    expected = newton_schulz_exchange_bytes(shapes, patterns, WORLD_SIZE, sharded=layout == "fsdp2",
                                            itemsize=result["ns_itemsize"])
    assert result["bytes_per_rank"] == [[traffic] * scenario.STEPS for traffic in expected]


@pytest.mark.distributed
@pytest.mark.slow
def test_plain_parameters_with_different_updates_per_rank_are_refused(launched):
    assert "pass split_newton_schulz=False when each rank trains its own model" in launched["refusal"]


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_sharded_exchange_bytes_without_the_block_list_equal_the_full_plan(world_size):
    for config in (KimiK3Config(num_attention_heads=3), tiny_config(num_attention_heads=3, v_head_dim=4)):
        with torch.device("meta"):
            shapes, patterns = muon_shapes_and_patterns(build_param_groups(KimiK3ForCausalLM(config)))
        plan = plan_exchange(shapes, patterns, world_size, True, NS_STEPS)
        assert sharded_exchange_bytes(shapes, patterns, world_size, NS_STEPS, 2) == exchange_bytes(plan, 2)
