"""Newton–Schulz split across ranks: the block plan in this process against listing every block, 2 gloo processes
against one, and 4 processes training with expert parallelism against one.

The 2-process run (``tests/dist_scripts/split_newton_schulz.py``) steps the default ``KimiK3Config()`` model (and tiny
ones with mixed block shapes), replicated as under DDP, FSDP2-sharded, and sharded by transformers with expert or tensor
parallelism, on gradients that depend only on the parameter name and step; the test repeats the steps in this process
with the same gradients. The 4-process run (``tests/dist_scripts/expert_parallel_muon.py``) trains through Trainer on a
model loaded with ``DistributedConfig(fsdp_size=4, ep_size=2)``; the test replays its optimizer steps here."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.flop_counter import FlopCounterMode

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.optim.muon import (
    NS_STEPS,
    PerHeadMuon,
    build_param_groups,
    muon_shapes_and_patterns,
    newton_schulz_exchange_bytes,
)
from kimi_k3.planning.plan import Layout, Setup, make_plan
from kimi_k3.planning.verify import fake_process_group
from kimi_k3.parallel.shard_layout import matrix_shape, mesh_holdings
from kimi_k3.optim.newton_schulz import newton_schulz_flops, queue_flops
from kimi_k3.optim.split_newton_schulz import (
    Block,
    assign_blocks,
    fsdp_holdings,
    plan_exchange,
    plan_sharded,
    row_blocks,
)
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import HANG_CEILING_S, tiny_config, torchrun
from tests.dist_scripts import expert_parallel_muon as expert_parallel_scenario
from tests.dist_scripts import split_newton_schulz as scenario

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = HANG_CEILING_S


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
def test_fsdp_holdings_are_the_rows_torch_chunk_gives_each_rank(shape):
    rows = torch.arange(torch.Size(shape).numel()).view(shape)
    chunks = rows.chunk(4)
    for rank, holding in enumerate(fsdp_holdings(shape, 4)):
        expected = chunks[rank].reshape(-1, shape[-1]) if rank < len(chunks) else rows[:0].reshape(-1, shape[-1])
        held = [row for start, stop in holding.rows for row in range(start, stop)]
        assert torch.equal(rows.reshape(-1, shape[-1])[held], expected)
        assert holding.cols == (((0, shape[-1]),) if held else ())


def test_assignment_keeps_whole_blocks_home_and_balances_the_rest_largest_first():
    flops = [5, 5, 9, 1, 4, 3]
    homes = [0, 0, None, None, None, 1]
    assert assign_blocks(flops, homes, 2) == [0, 0, 1, 1, 0, 1]  # loads 10 + 4 = 14 and 3 + 9 + 1 = 13


def test_default_model_blocks_split_evenly_by_flops_in_both_layouts():
    shapes, patterns = default_model_muon_shapes()
    for sharded in (False, True):
        plan = plan_exchange(shapes, patterns, WORLD_SIZE, sharded, NS_STEPS)
        loads = plan.flops_per_rank()
        assert plan.block_count == 1737 and sum(loads) == pytest.approx(117.0e9, rel=1e-3)
        assert max(loads) / min(loads) < 1.01
        assert plan_exchange(shapes, patterns, WORLD_SIZE, sharded, NS_STEPS).flops_per_rank() == loads


def test_exchange_bytes_of_replicated_and_row_sharded_parameters():
    shapes, patterns = [(8, 4), (4, 2, 3)], [(2,), (2,)]  # 4 blocks of 2x4, then 4 blocks of 2x3 (2 experts)
    replicated = newton_schulz_exchange_bytes(shapes, patterns, 2, sharded=False, itemsize=2)
    # Each rank owns 4 blocks: two 2x4 and two 2x3 (largest first, alternating), 28 elements; all-gather (N-1)·28·2.
    assert replicated == [(56, 56), (56, 56)]
    # Row-sharded: every block lies inside one rank's rows, so nothing travels.
    assert newton_schulz_exchange_bytes(shapes, patterns, 2, sharded=True, itemsize=2) == [(0, 0), (0, 0)]
    # One 3x4 whole matrix over 2 ranks: rows 0-1 on rank 0 (its owner), row 2 on rank 1, sent there and back.
    assert newton_schulz_exchange_bytes([(3, 4)], [None], 2, sharded=True, itemsize=4) == [(16, 16), (16, 16)]


def reference_assignment(shapes, patterns, holdings, world_size):
    """The sharded plan the slow way: every block listed, the rank of every element of it looked up, homes and owners
    by :func:`assign_blocks`, and the elements every piece held away from its owner moves (there and back)."""
    holder_of = []
    for shape, held in zip(shapes, holdings):
        rank_of = torch.full(matrix_shape(shape), -1)
        for rank, holding in enumerate(held):
            for row_start, row_stop in holding.rows:
                for col_start, col_stop in holding.cols:
                    rank_of[row_start:row_stop, col_start:col_stop] = rank
        assert (rank_of >= 0).all()
        holder_of.append(rank_of)
    blocks = [block for param, (shape, pattern) in enumerate(zip(shapes, patterns))
              for block in row_blocks(param, shape, pattern)]
    ranks = [holder_of[block.param][block.start:block.stop].unique().tolist() for block in blocks]
    homes = [block_ranks[0] if len(block_ranks) == 1 else None for block_ranks in ranks]
    flops = [newton_schulz_flops(block.rows, block.cols, NS_STEPS) for block in blocks]
    owners = assign_blocks(flops, homes, world_size)
    loads, moved = [0] * world_size, [0] * world_size
    for block, owner, block_flops in zip(blocks, owners, flops):
        loads[owner] += block_flops
        counts = torch.bincount(holder_of[block.param][block.start:block.stop].flatten(), minlength=world_size)
        for rank, count in enumerate(counts.tolist()):
            if rank != owner:
                moved[rank] += count
                moved[owner] += count
    cut_owners = [owner for owner, home in zip(owners, homes) if home is None]
    return loads, moved, cut_owners


def random_layouts(generator, count):
    """Parameters of random shapes and block patterns, each under one of the layouts the project produces."""
    layouts = [
        ((3,), lambda ndim: (Shard(0),)),
        ((5,), lambda ndim: (Shard(0),)),
        ((2, 2), lambda ndim: (_StridedShard(0, split_factor=2), Shard(0)) if ndim == 3 else (Shard(0), Shard(1))),
        ((2,), lambda ndim: (Shard(ndim - 1),)),
        ((2,), lambda ndim: (_StridedShard(ndim - 2, split_factor=2),)),
    ]
    mesh_shape, placements_of = layouts[int(torch.randint(len(layouts), (), generator=generator))]
    world_size = math.prod(mesh_shape)
    shapes, patterns, holdings = [], [], []
    for _ in range(count):
        sizes = [int(size) for size in torch.randint(1, 5, (int(torch.randint(1, 3, (), generator=generator)),),
                                                     generator=generator)]
        rows = sum(sizes) * int(torch.randint(1, 4, (), generator=generator)) * 2  # even: strided row splits
        experts = int(torch.randint(2, 6, (), generator=generator)) * 2
        shape = (experts, rows, int(torch.randint(2, 9, (), generator=generator)) * 2)
        shape = shape if torch.rand((), generator=generator) < 0.5 else shape[1:]
        pattern = tuple(sizes) if torch.rand((), generator=generator) < 0.7 else None
        by_rank = mesh_holdings(shape, mesh_shape, tuple(range(world_size)), placements_of(len(shape)))
        shapes.append(shape)
        patterns.append(pattern)
        holdings.append(tuple(by_rank[rank] for rank in range(world_size)))
    return shapes, patterns, holdings, world_size


@pytest.mark.parametrize("seed", range(12))
def test_sharded_plan_equals_listing_every_block_and_element(seed):
    shapes, patterns, holdings, world_size = random_layouts(torch.Generator().manual_seed(seed), count=4)
    plan = plan_sharded(shapes, patterns, holdings, NS_STEPS)
    loads, moved, cut_owners = reference_assignment(shapes, patterns, holdings, world_size)
    assert plan.flops_per_rank() == loads
    assert plan.moved_elements() == moved
    assert plan.cut_owners == cut_owners
    assert plan.block_count == sum(len(row_blocks(0, shape, pattern)) for shape, pattern in zip(shapes, patterns))


def test_expert_parallel_blocks_stay_home_and_only_cut_dense_blocks_travel():
    """Two 4-row experts of [4, 3] per rank on a (efsdp 2, ep 2) mesh: no piece of them travels; a dense [6, 3]
    matrix over the same 4 ranks (2, 2, 2, 0 rows) is one block cut three ways."""
    experts = (8, 4, 3)
    expert_holdings = mesh_holdings(experts, (2, 2), (0, 1, 2, 3), (_StridedShard(0, split_factor=2), Shard(0)))
    assert [expert_holdings[rank].rows for rank in range(4)] == [((0, 8),), ((16, 24),), ((8, 16),), ((24, 32),)]
    plan = plan_sharded([experts, (6, 3)], [(4,), None],
                        [tuple(expert_holdings[rank] for rank in range(4)), fsdp_holdings((6, 3), 4)], NS_STEPS)
    assert [len(pieces) for _, _, pieces in plan.cut] == [3]
    owner = plan.cut_owners[0]
    # Each way, the owner gets two others' 2 x 3 rows (inputs) and sends them back (results); the holders the same.
    assert plan.moved_elements()[owner] == 2 * 2 * 3
    assert sorted(plan.moved_elements()) == [0, 2 * 3, 2 * 3, 2 * 2 * 3]


# ---------------------------------------------------------------------------------------------------------------------
# 2 processes against one
# ---------------------------------------------------------------------------------------------------------------------
def configs() -> dict[str, KimiK3Config]:
    """The default model; a tiny one whose kv_b_proj has K and V blocks of different shapes (two RMS scales in one
    parameter) and whose 3 MLA heads put a shard boundary inside a head; the same with 2 heads, which tensor
    parallelism splits (one head per rank)."""
    return {"default": KimiK3Config(), "mixed_blocks": tiny_config(num_attention_heads=3, v_head_dim=4),
            "two_heads": tiny_config(v_head_dim=4)}


# Expert and tensor parallelism run on the tiny models only: they add no Newton–Schulz work, only layouts. The tiny
# models run with Newton–Schulz forced to bf16 and to fp32, so both paths are checked whatever "auto" picks on this
# CPU; the default model keeps "auto" (bf16 forced where it is emulated would cost its 117 GFLOP many times over).
RUN_SPECS = {  # run -> (config, Newton–Schulz precision, layouts)
    "default": ("default", "auto", ["ddp", "fsdp2"]),
    **{f"{config} {short}": (config, dtype, layouts)
       for config, layouts in {"mixed_blocks": ["ddp", "fsdp2", "ep"], "two_heads": ["ep", "tp"]}.items()
       for short, dtype in (("bf16", "bfloat16"), ("fp32", "float32"))},
}
RUNS = [(run, layout) for run, (_, _, layouts) in RUN_SPECS.items() for layout in layouts]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    work = tmp_path_factory.mktemp("split_newton_schulz")
    for name, config in configs().items():
        config.to_json_file(work / f"{name}.json")
    runs = {run: {"config": config, "ns_dtype": dtype, "layouts": layouts}
            for run, (config, dtype, layouts) in RUN_SPECS.items()}
    (work / "runs.json").write_text(json.dumps(runs))
    torchrun(str(Path(scenario.__file__)), str(work), nproc=WORLD_SIZE, timeout_s=LAUNCH_TIMEOUT_S)
    return torch.load(work / "split.pt", weights_only=False)


@pytest.fixture(scope="module")
def single_process():
    models = configs()
    return {run: scenario.single_process(models[config], dtype) for run, (config, dtype, _) in RUN_SPECS.items()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("config", "layout"), RUNS)
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
def test_steps_with_the_compiled_elementwise_passes_are_bitwise_the_single_process_update(
    layout, launched, single_process
):
    """Outside the FLOP counter the default model's expert tensors take Per-Head Muon's compiled elementwise passes
    (plain tensors under DDP, the local shards under FSDP2); the single process ran them eagerly under the counter."""
    state, expected_state = launched["not counted"][layout], single_process["default"]["state"]
    assert state.keys() == expected_state.keys()
    for name, expected in expected_state.items():
        assert torch.equal(state[name], expected), name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("config", "layout"), RUNS)
def test_measured_traffic_is_what_the_optimizers_plans_give_each_rank(config, layout, launched):
    result = launched[config][layout]
    planned = result["planned_bytes_per_rank"]
    assert result["bytes_per_rank"] == [[tuple(rank)] * scenario.STEPS for rank in planned]
    if layout in ("ep", "tp"):
        assert all(sent > 0 for sent, _ in planned)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_each_rank_does_half_the_newton_schulz_flops(layout, launched, single_process):
    """Counted by torch's FlopCounterMode around every optimizer step, on each rank and in the single process: exactly
    the FLOPs of the Newton–Schulz calls each rank's plan gives it (its blocks in whole chunks), about half of the single
    process's (every block in whole chunks)."""
    result = launched["default"][layout]
    assert result["flops_per_rank"] == [[planned] * scenario.STEPS for planned in result["planned_flops_per_rank"]]
    shapes, patterns = default_model_muon_shapes()
    blocks = [(block.rows, block.cols) for param, (shape, pattern) in enumerate(zip(shapes, patterns))
              for block in row_blocks(param, shape, pattern)]
    assert single_process["default"]["flops"] == [queue_flops(blocks)] * scenario.STEPS
    assert queue_flops(blocks) > 100e9  # the default model's 117 GFLOP of Newton–Schulz
    per_rank = torch.tensor(result["planned_flops_per_rank"], dtype=torch.float64)
    assert torch.all((per_rank / (queue_flops(blocks) / WORLD_SIZE) - 1).abs() < 0.10)


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


# ---------------------------------------------------------------------------------------------------------------------
# 4 processes, expert parallelism 2 x FSDP 2, through Trainer
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory):
    work = tmp_path_factory.mktemp("expert_parallel_muon")
    torch.manual_seed(0)
    # Experts large enough that one whole expert tensor outweighs everything the step exchanges for the dense blocks,
    # and Newton–Schulz's largest call (CHUNK_ELEMENTS blocks' elements, fp32 where bf16 is emulated).
    config = tiny_config(num_experts=16, moe_intermediate_size=128, routed_expert_hidden_size=192)
    KimiK3ForCausalLM(config).save_pretrained(work / "initial")
    torchrun(str(Path(expert_parallel_scenario.__file__)), str(work), nproc=expert_parallel_scenario.WORLD_SIZE,
             timeout_s=LAUNCH_TIMEOUT_S)
    return config, torch.load(work / "expert_parallel_muon.pt", weights_only=False)


@pytest.fixture(scope="module")
def replayed(expert_parallel):
    """The launched run's optimizer steps in one process: its first weights, then its gradients, step by step."""
    config, launched = expert_parallel
    model = KimiK3ForCausalLM(config)
    model.load_state_dict(launched["steps"][0]["params"], strict=False)
    optimizer = PerHeadMuon.for_model(model, **launched["optimizer_kwargs"])
    weights, flops = [], []
    for step in launched["steps"]:
        for name, p in model.named_parameters():
            p.grad = step["grads"].get(name)
        with FlopCounterMode(display=False) as counter:
            optimizer.step()
        flops.append(counter.get_total_flops())
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return {"weights": weights, "flops": flops}


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_run_holds_two_whole_experts_per_rank_on_a_2x2_mesh(expert_parallel):
    config, launched = expert_parallel
    for rank in launched["ranks"]:
        mesh_shape, placements, local_shape = rank["layout"]
        assert mesh_shape == (2, 2) and placements == (_StridedShard(0, split_factor=2), Shard(0))
        assert local_shape[0] == config.num_experts // 4


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_newton_schulz_updates_are_bitwise_one_process_over_steps_with_momentum(
    expert_parallel, replayed
):
    _, launched = expert_parallel
    for step, expected in zip(launched["steps"], replayed["weights"]):
        assert step["after"].keys() == expected.keys()
        for name, weight in expected.items():
            assert torch.equal(step["after"][name], weight), name
        moved = [name for name in expected if not torch.equal(step["params"][name], step["after"][name])]
        assert any("experts.gate_up_proj" in name for name in moved) and any("q_proj" in name for name in moved)


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_ranks_each_do_a_quarter_of_the_newton_schulz_flops(expert_parallel):
    """Each rank's FLOPs, counted by torch, are those of the calls its plan gives it (its blocks in whole chunks); the
    blocks it orthogonalises are a quarter of all blocks' FLOPs. (The tiny model's blocks fill few chunks, so padding is
    much of what the calls count.)"""
    config, launched = expert_parallel
    ranks = launched["ranks"]
    assert [rank["flops"] for rank in ranks] == [[rank["planned_call_flops"]] * expert_parallel_scenario.STEPS
                                                 for rank in ranks]
    shapes, patterns = muon_shapes_and_patterns(build_param_groups(KimiK3ForCausalLM(config)))
    every_block = sum(newton_schulz_flops(block.rows, block.cols) for param, (shape, pattern)
                      in enumerate(zip(shapes, patterns)) for block in row_blocks(param, shape, pattern))
    per_rank = torch.tensor([rank["planned_block_flops"] for rank in ranks], dtype=torch.float64)
    assert per_rank.sum().item() == every_block
    assert torch.all((per_rank / (every_block / 4) - 1).abs() < 0.10), per_rank / (every_block / 4)


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_step_never_holds_a_whole_expert_tensor(expert_parallel):
    """Counted inside every optimizer step on every rank: the bytes of the largest tensor any operation creates (a
    DTensor by its local shard), and of what each collective delivers, against the smaller of the two whole expert
    tensors of one layer (down_proj, fp32). Gathering it whole would take one of each at least that large."""
    config, launched = expert_parallel
    whole_expert_bytes = config.num_experts * config.routed_expert_hidden_size * config.moe_intermediate_size * 4
    for rank in launched["ranks"]:
        assert max(rank["largest_tensor"]) < whole_expert_bytes
        assert max(size for received in rank["received"] for size in received) < whole_expert_bytes


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_traffic_is_the_planners(expert_parallel):
    """The planner's block assignment for Layout(4, 4, ep=2) of this model: what each rank hands to the two
    all-to-alls of every step."""
    config, launched = expert_parallel
    rank_bytes = launched["ranks"][0]["ns_itemsize"]
    setup = Setup(sequence_length=16, ns_dtype="fp32" if rank_bytes == 4 else "bf16")
    plan = make_plan(config, Layout(4, 4, ep=2), setup)
    expected = [moved * rank_bytes for moved in plan.newton_schulz.moved_elements()]
    assert [rank["given"] for rank in launched["ranks"]] == [[moved] * expert_parallel_scenario.STEPS
                                                            for moved in expected]


@pytest.mark.parametrize(
    ("mesh_shape", "world_size", "placements", "reason"),
    [
        ((2, 2), 4, (Shard(0), Replicate()), "a mesh dim of 2 ranks replicates the shards"),
        ((4,), 4, (Partial(),), "Partial(sum) is neither Shard nor Replicate"),
        ((2, 2), 8, (Shard(0), Shard(1)), "its 2-D mesh holds 4 of the 8 ranks"),
    ],
    ids=["hsdp", "partial", "2d-mesh-of-some-ranks"],
)
def test_a_layout_the_split_cannot_describe_is_refused_at_the_first_step_naming_the_parameter(
    mesh_shape, world_size, placements, reason
):
    with fake_process_group(world_size):
        mesh = DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).view(mesh_shape))
        if any(isinstance(placement, Partial) for placement in placements):
            weight = DTensor.from_local(torch.zeros(8, 4), mesh, placements, run_check=False)
        else:
            weight = distribute_tensor(torch.zeros(8, 4), mesh, placements, src_data_rank=None)
        weight = torch.nn.Parameter(weight)
        optimizer = PerHeadMuon([{"params": [weight], "param_names": ["model.layers.0.mlp.up_proj.weight"]}])
        weight.grad = torch.zeros_like(weight)
        with pytest.raises(ValueError) as refusal:
            optimizer.step()
    message = str(refusal.value)
    assert message.startswith("Per-Head Muon cannot split Newton–Schulz of model.layers.0.mlp.up_proj.weight "
                              f"(placements {placements} on a mesh of shape {mesh_shape})")
    assert reason in message and "pass split_newton_schulz=False" in message and "\n" not in message
