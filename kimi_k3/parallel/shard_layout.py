"""Which rows and columns of a parameter every rank holds, read from its DTensor mesh and placements.

Newton–Schulz orthogonalises row blocks of an update viewed as a matrix [rows, cols]: every dim but the last is
flattened into rows. Along each tensor dim a rank's shard is an increasing list of global indices, found the way DTensor
finds it: the placements are applied over the mesh dims from left to right, ``Shard(d)`` keeping the ``torch.chunk``
piece of the indices kept so far that the rank's mesh coordinate selects, ``_StridedShard(d, split_factor)`` the
strided selection torch defines for it (FSDP2 over a dim that another mesh dim shards first: the experts under
transformers' ``DistributedConfig(fsdp_size, ep_size)``, the packed gate/up rows under tensor parallelism). In the
matrix view a shard is then the product of runs of flattened rows and runs of columns, [start, stop) ranges in
increasing order, which is also the order of the local tensor.

Only layouts where every element lives on exactly one rank are described: a mesh dim of size > 1 that replicates a
sharded tensor (HSDP) or holds a partial sum has no single holder per element, and is refused with the reason.
"""

import functools
import itertools
import math
from dataclasses import dataclass

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

Runs = tuple[tuple[int, int], ...]


class LayoutError(ValueError):
    """A mesh or placement whose shards the optimizer cannot describe; the message says why, in one clause."""


@dataclass(frozen=True)
class Holding:
    """The part of a [rows, cols] matrix view one rank holds: every row of ``rows`` times every column of ``cols``."""

    rows: Runs
    cols: Runs

    @property
    def row_count(self) -> int:
        return sum(stop - start for start, stop in self.rows)

    @property
    def col_count(self) -> int:
        return sum(stop - start for start, stop in self.cols)

    @property
    def numel(self) -> int:
        return self.row_count * self.col_count

    def holds_all_columns(self, cols: int) -> bool:
        return self.cols == ((0, cols),)

    def row_slice(self, start: int, stop: int) -> slice:
        """Local rows of the global rows [start, stop), which lie in one run."""
        return _local_slice(self.rows, start, stop)

    def col_slice(self, start: int, stop: int) -> slice:
        return _local_slice(self.cols, start, stop)


def _local_slice(runs: Runs, start: int, stop: int) -> slice:
    offset = 0
    for first, last in runs:
        if first <= start and stop <= last:
            return slice(offset + start - first, offset + stop - first)
        offset += last - first
    raise IndexError(f"[{start}, {stop}) is not inside one of the runs {runs}")


def matrix_shape(shape) -> tuple[int, int]:
    """[rows, cols] of the matrix view of a tensor of ``shape``."""
    return math.prod(shape[:-1]), shape[-1]


def check_placements(placements, mesh_shape) -> None:
    """Refuse placements whose shards :func:`mesh_holdings` cannot describe."""
    for placement, size in zip(placements, mesh_shape):
        if isinstance(placement, (Shard, _StridedShard)) or size == 1:
            continue
        if not isinstance(placement, Replicate):
            raise LayoutError(f"{placement!r} is neither Shard nor Replicate")
        if any(isinstance(other, (Shard, _StridedShard)) for other in placements):
            raise LayoutError(f"a mesh dim of {size} ranks replicates the shards (each element on several ranks)")


def held_indices(shape, mesh_shape, coordinate, placements) -> list:
    """Global indices, per tensor dim, of the shard at mesh ``coordinate`` (in the local tensor's order)."""
    indices = [range(size) for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):
            kept = indices[placement.dim]
            positions = _kept_positions(placement, len(kept), mesh_shape[mesh_dim], coordinate[mesh_dim])
            indices[placement.dim] = kept[positions] if isinstance(positions, slice) else [kept[i] for i in positions]
    return indices


@functools.lru_cache(maxsize=4096)
def _kept_positions(placement, size: int, chunks: int, index: int):
    """Positions, among ``size`` indices kept so far, that mesh index ``index`` of ``chunks`` keeps under
    ``placement``: torch's own rule for each kind (a slice for ``Shard``, a list for ``_StridedShard``)."""
    if isinstance(placement, _StridedShard):
        return tuple(placement.local_shard_size_and_offset(size, chunks, index, _StridedShardOffsetMode.ALL)[1])
    length, start = Shard.local_shard_size_and_offset(size, chunks, index)
    return slice(start, start + length)


def runs_of(indices) -> Runs:
    """Increasing ``indices`` as maximal [start, stop) runs; a shard out of increasing order is refused."""
    if isinstance(indices, range) and indices.step == 1:
        return ((indices.start, indices.stop),) if len(indices) else ()
    runs = []
    for index in indices:
        if runs and index == runs[-1][1]:
            runs[-1][1] += 1
        elif runs and index < runs[-1][1]:
            raise LayoutError("a shard holds its indices out of increasing order")
        else:
            runs.append([index, index + 1])
    return tuple((start, stop) for start, stop in runs)


def flattened_runs(per_dim_runs, sizes) -> Runs:
    """Runs of flattened indices over dims of ``sizes`` (row-major) held as the product of ``per_dim_runs``."""
    flat = [(0, 1)]
    for runs, size in zip(per_dim_runs, sizes):
        if runs == ((0, size),):
            flat = [(start * size, stop * size) for start, stop in flat]
            continue
        flat = [(outer * size + start, outer * size + stop)
                for first, last in flat for outer in range(first, last) for start, stop in runs]
    merged = []
    for start, stop in flat:
        if merged and merged[-1][1] == start:
            merged[-1][1] = stop
        elif start < stop:
            merged.append([start, stop])
    return tuple((start, stop) for start, stop in merged)


@functools.lru_cache(maxsize=4096)
def mesh_holdings(shape: tuple[int, ...], mesh_shape: tuple[int, ...], mesh_ranks: tuple[int, ...],
                  placements: tuple) -> dict[int, Holding]:
    """Global rank -> :class:`Holding` of a tensor of global ``shape`` on a mesh of ``mesh_shape`` whose ranks, in
    row-major order of their coordinates, are ``mesh_ranks``, with ``placements``."""
    check_placements(placements, mesh_shape)
    coordinates = itertools.product(*map(range, mesh_shape))
    return {rank: holding_at(shape, mesh_shape, coordinate, placements)
            for coordinate, rank in zip(coordinates, mesh_ranks)}


@functools.lru_cache(maxsize=65536)
def holding_at(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
               placements: tuple) -> Holding:
    """The :class:`Holding` of the rank at mesh ``coordinate`` (placements as :func:`check_placements` accepts)."""
    per_dim = [runs_of(indices) for indices in held_indices(shape, mesh_shape, coordinate, placements)]
    if any(not runs for runs in per_dim):
        return Holding((), ())
    return Holding(flattened_runs(per_dim[:-1], shape[:-1]), per_dim[-1])


def dtensor_holdings(tensor: DTensor) -> dict[int, Holding]:
    """:func:`mesh_holdings` of a DTensor's global shape, mesh and placements."""
    mesh = tensor.device_mesh.mesh
    return mesh_holdings(tuple(tensor.shape), tuple(mesh.shape), tuple(mesh.flatten().tolist()),
                         tuple(tensor.placements))


def check_local_shard(tensor: DTensor, holding: Holding) -> None:
    """The holding this rank computed must be the shard DTensor gives it: local shape, and first global index per dim
    (``__create_chunk_list__``, what distributed checkpointing reads)."""
    local = tensor.to_local()
    if local.numel() == 0 and holding.numel == 0:
        return
    chunk = tensor.__create_chunk_list__()[0]
    rows, cols = matrix_shape(tuple(local.shape))
    first_row = holding.rows[0][0] if holding.rows else None
    expected_first_row = sum(o * math.prod(tensor.shape[d + 1:-1]) for d, o in enumerate(chunk.offsets[:-1]))
    if (rows, cols) != (holding.row_count, holding.col_count) or first_row != expected_first_row \
            or holding.cols[0][0] != chunk.offsets[-1]:
        raise LayoutError(
            f"the computed shard ({holding.row_count} x {holding.col_count} from row {first_row}) is not the local "
            f"one ({rows} x {cols} at offsets {tuple(chunk.offsets)})"
        )
