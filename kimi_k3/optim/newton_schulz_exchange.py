"""One optimizer step of split Newton–Schulz on one rank: the exchange of blocks that
:mod:`kimi_k3.optim.split_newton_schulz` plans.

Replicated parameters: each rank orthogonalises its own blocks and one all-gather hands every rank every block.
Sharded parameters: :class:`CutBlockExchange` moves the pieces of cut blocks to their owners and back in two
all-to-alls of raw bytes (already in the Newton–Schulz dtype), and :class:`HomeBlocks` hands a parameter's home blocks,
where they lie, to Newton–Schulz and puts its rows together. Newton–Schulz is batch-invariant
(:mod:`kimi_k3.optim.newton_schulz`), so every rank ends the step with bitwise the single-process update.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kimi_k3.optim.split_newton_schulz import ReplicatedPlan, ShardedPlan, block_sizes


# ---------------------------------------------------------------------------------------------------------------------
# One step, replicated
# ---------------------------------------------------------------------------------------------------------------------
def orthogonalize_replicated(updates, patterns, dtypes, group, plan: ReplicatedPlan, orthogonalize, ns_dtype,
                             scale_of):
    """Every orthogonalised update on every rank, per parameter: (tensor of the update's shape, alpha scale).

    ``orthogonalize(stacks)`` is Newton–Schulz on a list of [n, rows, cols] stacks (outputs in ``ns_dtype``);
    ``scale_of(rows, cols)`` the RMS-matching factor of a block. A parameter whose blocks share one factor gets it as
    the returned scale (applied in the final add); otherwise its rows come back in ``dtypes[p]`` already scaled.
    """
    rank = dist.get_rank(group)
    matrices = [_matrix(_local(update)) for update in updates]
    owned = plan.owned(rank)
    stacks = [matrices[plan.blocks[i].param][plan.blocks[i].start:plan.blocks[i].stop].unsqueeze(0) for i in owned]
    outputs = [output[0] for output in orthogonalize(stacks)]
    shares = [plan.share_elements(r) for r in range(plan.world_size)]
    mine = torch.zeros(max(shares), dtype=ns_dtype, device=matrices[0].device)
    if outputs:
        torch.cat([output.reshape(-1) for output in outputs], out=mine[:shares[rank]])
    gathered = [torch.empty_like(mine) for _ in range(plan.world_size)]
    dist.all_gather([_as_bytes(t) for t in gathered], _as_bytes(mine), group=group)
    scales = [_block_scales(block_sizes(update.shape, pattern), update.shape[-1], scale_of)
              for update, pattern in zip(updates, patterns)]
    merged = [torch.empty(matrix.shape, dtype=ns_dtype if len(scale) == 1 else dtype, device=mine.device)
              for matrix, scale, dtype in zip(matrices, scales, dtypes)]
    for owner, flat in enumerate(gathered):
        offset = 0
        for index in plan.owned(owner):
            block = plan.blocks[index]
            values = flat[offset:offset + block.rows * block.cols].view(block.rows, block.cols)
            target = merged[block.param]
            single = len(scales[block.param]) == 1
            target[block.start:block.stop] = values if single else values.to(target.dtype) * scale_of(*values.shape)
            offset += block.rows * block.cols
    return [(_layout_of(update)(result), next(iter(scale)) if len(scale) == 1 else 1.0)
            for update, result, scale in zip(updates, merged, scales)]


def _block_scales(sizes, cols: int, scale_of) -> set[float]:
    """The RMS-matching factors of a parameter's blocks: one, or one per block height when they differ."""
    return {scale_of(size, cols) for size in sizes}


# ---------------------------------------------------------------------------------------------------------------------
# One step, sharded
# ---------------------------------------------------------------------------------------------------------------------
class CutBlockExchange:
    """One rank's part in exchanging a step's cut blocks: :meth:`take` each parameter's local update, then :meth:`run`
    returns the orthogonalised rows of every cut-block piece this rank holds."""

    def __init__(self, plan: ShardedPlan, rank: int, ns_dtype: torch.dtype, device):
        self.plan, self.rank, self.ns_dtype, self.device = plan, rank, ns_dtype, device
        self.view = plan.view(rank)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}

    def holds_cut_pieces(self, param: int) -> bool:
        return bool(self.view.held[param])

    def take(self, param: int, matrix: torch.Tensor) -> None:
        """Keep, in the Newton–Schulz dtype, this rank's pieces of ``param``'s cut blocks from its local update viewed
        as [rows, cols]."""
        holding = self.plan.holdings[param][self.rank]
        for pair in self.view.held[param]:
            piece = self.plan.piece(pair)
            rows, cols = holding.row_slice(piece.row_start, piece.row_stop), holding.col_slice(piece.col_start,
                                                                                              piece.col_stop)
            self.inputs[pair] = matrix[rows, cols].to(self.ns_dtype, copy=True)  # U is freed after

    def run(self, orthogonalize, group) -> dict[tuple[int, int], torch.Tensor]:
        if not self.plan.cut:
            return {}
        view = self.view
        received = self._all_to_all([[self.inputs[pair] for pair in pairs] for pairs in view.outgoing],
                                    view.incoming, group)
        blocks = {index: torch.empty(self.plan.cut_block(index)[1], self.plan.tilings[self.plan.cut[index][0]].cols,
                                     dtype=self.ns_dtype, device=self.device) for index in view.owned}
        arrived = {pair: self.inputs[pair] for pair in self.inputs if pair[0] in blocks}
        arrived.update(_pairs_with(view.incoming, received))
        for pair, rows in arrived.items():
            blocks[pair[0]][self._within_block(pair)] = rows
        outputs = dict(zip(view.owned, (out[0] for out in orthogonalize([blocks[i].unsqueeze(0) for i in view.owned]))))
        returned = self._all_to_all([[outputs[pair[0]][self._within_block(pair)] for pair in pairs]
                                     for pairs in view.incoming], view.outgoing, group)
        results = {pair: outputs[pair[0]][self._within_block(pair)] for pair in self.inputs if pair[0] in outputs}
        results.update(_pairs_with(view.outgoing, returned))
        return results

    def _within_block(self, pair) -> tuple[slice, slice]:
        piece = self.plan.piece(pair)
        start = self.plan.cut_block(pair[0])[0]
        return slice(piece.row_start - start, piece.row_stop - start), slice(piece.col_start, piece.col_stop)

    def _all_to_all(self, sends, expected, group):
        """One all-to-all of row pieces as raw bytes; per source rank, the received pieces as [rows, cols] tensors."""
        dtype = self.ns_dtype
        send = [torch.cat([t.reshape(-1) for t in pieces]) if pieces else torch.empty(0, dtype=dtype,
                                                                                        device=self.device)
                for pieces in sends]
        shapes = [[self._piece_shape(pair) for pair in pairs] for pairs in expected]
        recv_sizes = [sum(rows * cols for rows, cols in pieces) * dtype.itemsize for pieces in shapes]
        recv_bytes = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(recv_bytes, torch.cat([_as_bytes(t) for t in send]), output_split_sizes=recv_sizes,
                               input_split_sizes=[t.numel() * dtype.itemsize for t in send], group=group)
        received = []
        for pieces, chunk in zip(shapes, recv_bytes.split(recv_sizes)):
            values = chunk.view(dtype)
            tensors, offset = [], 0
            for rows, cols in pieces:
                tensors.append(values[offset:offset + rows * cols].view(rows, cols))
                offset += rows * cols
            received.append(tensors)
        return received

    def _piece_shape(self, pair) -> tuple[int, int]:
        piece = self.plan.piece(pair)
        return piece.row_stop - piece.row_start, piece.col_stop - piece.col_start


def _pairs_with(pairs_per_rank, tensors_per_rank):
    """(piece, rows) for the pieces of every rank and the tensors received from (or returned by) it."""
    for pairs, tensors in zip(pairs_per_rank, tensors_per_rank):
        yield from zip(pairs, tensors)


class HomeBlocks:
    """A parameter's blocks that lie whole in this rank's shard (its home blocks), as stacks of one height each, and
    what turns their orthogonalised rows, with the rank's pieces of cut blocks, back into the parameter's local update.

    It keeps the update's layout, not its values, so the update can be freed once its blocks are submitted."""

    def __init__(self, plan: ShardedPlan, rank: int, param: int, update: torch.Tensor):
        self.plan, self.rank, self.param = plan, rank, param
        self.starts_by_size = {}
        for start, size in plan.home_blocks(param, rank):
            self.starts_by_size.setdefault(size, []).append(start)
        matrix = _matrix(_local(update))
        self.matrix_shape, self.device = matrix.shape, matrix.device
        self.as_update = _layout_of(update)

    def stacks(self, update: torch.Tensor) -> list[torch.Tensor]:
        """The home blocks of ``update`` as [n, size, cols] stacks, one per block height (views where they can be)."""
        matrix = _matrix(_local(update))
        return [_row_stack(matrix, starts, size) for size, starts in self.starts_by_size.items()]

    def assemble(self, outputs, results, dtype: torch.dtype, ns_dtype: torch.dtype, scale_of):
        """This rank's orthogonalised update: ``outputs`` of :attr:`stacks`, and the pieces of cut blocks from
        ``results`` (:meth:`CutBlockExchange.run`); (tensor like the update, alpha scale), with the rule of
        :func:`orthogonalize_replicated` for parameters whose blocks have several RMS-matching factors."""
        plan, rank, param = self.plan, self.rank, self.param
        tiling, holding = plan.tilings[param], plan.holdings[param][rank]
        scales = _block_scales(tiling.sizes, tiling.cols, scale_of)
        single = len(scales) == 1
        merged = torch.empty(self.matrix_shape, dtype=ns_dtype if single else dtype, device=self.device)
        for (size, starts), output in zip(self.starts_by_size.items(), outputs):
            values = output if single else output.to(dtype) * scale_of(size, tiling.cols)
            if _consecutive(starts, size):
                merged[starts[0]:starts[0] + len(starts) * size] = values.reshape(-1, tiling.cols)
            else:
                for start, block in zip(starts, values):
                    merged[start:start + size] = block
        for pair in plan.view(rank).held[param]:
            piece = plan.piece(pair)
            rows = results[pair]
            merged[holding.row_slice(piece.row_start, piece.row_stop), holding.col_slice(piece.col_start,
                                                                                         piece.col_stop)] = (
                rows if single else rows.to(dtype) * scale_of(plan.cut_block(pair[0])[1], tiling.cols))
        return self.as_update(merged), (scales.pop() if single else 1.0)


def _row_stack(matrix: torch.Tensor, starts: list[int], size: int) -> torch.Tensor:
    """Blocks of ``size`` rows at ``starts`` as [n, size, cols]: a view when they are consecutive."""
    if _consecutive(starts, size):
        return matrix[starts[0]:starts[0] + len(starts) * size].view(len(starts), size, matrix.shape[-1])
    return torch.stack([matrix[start:start + size] for start in starts])


def _consecutive(starts: list[int], size: int) -> bool:
    return starts == list(range(starts[0], starts[0] + len(starts) * size, size))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _matrix(local: torch.Tensor) -> torch.Tensor:
    """A local tensor viewed as [rows, cols], empty shards included."""
    return local.reshape(math.prod(local.shape[:-1]), local.shape[-1])


def _layout_of(update: torch.Tensor):
    """The function that views a [rows, cols] local tensor as a tensor of ``update``'s kind and local shape (a DTensor
    with its layout, or a plain tensor), holding the layout but not ``update``'s values."""
    local_shape = _local(update).shape
    if not isinstance(update, DTensor):
        return lambda matrix: matrix.view(local_shape)
    mesh, placements, shape, stride = update.device_mesh, update.placements, update.shape, update.stride()
    return lambda matrix: DTensor.from_local(matrix.view(local_shape), mesh, placements, run_check=False, shape=shape,
                                             stride=stride)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)
