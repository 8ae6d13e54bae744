"""What every rank holds of a DTensor, computed from its mesh and placements, against DTensor's own shards: every rank
of small meshes (fake process group, one rank at a time), uneven sizes, strided shards and column splits."""

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from kimi_k3.planning.verify import fake_process_group
from kimi_k3.parallel.shard_layout import Holding, LayoutError, check_local_shard, dtensor_holdings, mesh_holdings

LAYOUTS = [
    ((10, 3), (4,), (Shard(0),)),  # FSDP2, uneven
    ((3, 5), (4,), (Shard(0),)),  # fewer rows than ranks: the last rank holds nothing
    ((9, 4, 2), (4,), (Shard(0),)),  # stacked matrices cut inside one
    ((8, 6, 5), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # experts: ep 2 x efsdp 2
    ((6, 6, 5), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # 3 experts per ep rank over 2
    ((8, 6, 5), (1, 4), (_StridedShard(0, split_factor=4), Shard(0))),  # ep = fsdp
    ((8, 12, 5), (2,), (_StridedShard(1, split_factor=2),)),  # tensor parallel packed gate/up rows
    ((8, 6, 10), (2,), (Shard(2),)),  # tensor parallel expert columns
    ((7, 10), (3,), (Shard(1),)),  # row-parallel columns, uneven
    ((8, 10), (2, 2), (Shard(0), Shard(1))),  # FSDP2 x tensor parallel
    ((8, 12, 6), (2, 2), (Shard(0), _StridedShard(1, split_factor=2))),
]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), LAYOUTS, ids=lambda value: str(value))
def test_holdings_are_the_elements_each_rank_of_a_dtensor_holds_in_local_order(shape, mesh_shape, placements):
    world_size = math.prod(mesh_shape)
    full = torch.arange(math.prod(shape)).view(shape)
    matrix = full.reshape(-1, shape[-1])
    held_elements = 0
    for rank in range(world_size):
        with fake_process_group(world_size, rank=rank):
            tensor = distribute_tensor(full, init_device_mesh("cpu", mesh_shape), placements, src_data_rank=None)
            holding = dtensor_holdings(tensor)[rank]
            check_local_shard(tensor, holding)
            local = tensor.to_local()
        rows = [row for start, stop in holding.rows for row in range(start, stop)]
        cols = [col for start, stop in holding.cols for col in range(start, stop)]
        expected = matrix[rows][:, cols] if rows and cols else matrix[:0, :0]
        assert torch.equal(local.reshape(-1, local.shape[-1]) if local.numel() else local.reshape(0, 0), expected)
        held_elements += holding.numel
    assert held_elements == full.numel()  # every element on exactly one rank


def test_local_slices_of_a_holding_follow_its_runs():
    holding = Holding(rows=((2, 4), (8, 11)), cols=((0, 3),))
    assert (holding.row_count, holding.numel) == (5, 15)
    assert holding.row_slice(9, 11) == slice(3, 5)
    with pytest.raises(IndexError, match="not inside one of the runs"):
        holding.row_slice(3, 9)


@pytest.mark.parametrize(
    ("mesh_shape", "placements", "reason"),
    [
        ((2, 2), (Shard(0), Replicate()), "replicates the shards"),
        ((4,), (Partial(),), "is neither Shard nor Replicate"),
    ],
)
def test_layouts_with_several_holders_per_element_are_refused_with_the_reason(mesh_shape, placements, reason):
    with pytest.raises(LayoutError, match=reason):
        mesh_holdings((8, 4), mesh_shape, tuple(range(math.prod(mesh_shape))), placements)


def test_a_local_shard_that_is_not_the_computed_one_is_refused():
    """Rank 0 of 2 claims 3 of 8 rows where torch.chunk gives it 4."""
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        tensor = DTensor.from_local(torch.zeros(3, 4), mesh, (Shard(0),), run_check=False, shape=(8, 4),
                                    stride=(4, 1))
        with pytest.raises(LayoutError, match=r"computed shard \(4 x 4 from row 0\) is not the local one \(3 x 4"):
            check_local_shard(tensor, dtensor_holdings(tensor)[0])
