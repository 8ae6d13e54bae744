"""Newton–Schulz split across data-parallel ranks: each rank orthogonalises only its share of the Muon blocks.

Without this every rank of a data-parallel run orthogonalises every block of every parameter, and N-1 of every N
Newton–Schulz FLOPs are thrown away. The scheme, for one optimizer step over the N ranks of a process group:

1. **Plan** (:func:`plan_exchange`, cached while the parameters keep their shapes). Every rank lists the same blocks
   in the same order (parameters in optimizer order, then rows; a block is ``rows`` consecutive rows of the update
   viewed as [rows, cols]) and assigns each to one rank with :func:`assign_blocks`: a block lying wholly in one
   rank's rows is that rank's, the others go, largest first, to the rank with the fewest FLOPs so far. The
   assignment is a pure function of the shapes, so it needs no communication and is the same on every rank.
2. **Replicated parameters** (DDP, or anything else that is the same on every rank): every rank has the whole update,
   orthogonalises its own blocks, and one all-gather (each share padded to the largest) hands every rank every
   block.
3. **Row-sharded parameters** (FSDP2 ``DTensor`` with ``Shard(0)`` on a 1-D mesh; rank r holds a contiguous range of
   the flattened rows, as ``torch.chunk`` splits dim 0): one all-to-all sends each block's owner the rows of it that
   other ranks hold, Newton–Schulz runs on whole blocks, and a second all-to-all returns to every rank the
   orthogonalised rows it holds. Blocks inside one shard (every expert matrix, most head blocks) never travel.
4. Every rank applies the rows it keeps. Newton–Schulz of one block does not depend on the other blocks batched with
   it, and the transport moves raw bytes, so every rank ends the step with bitwise the single-process update.

Inputs travel already cast to the Newton–Schulz dtype, the first thing Newton–Schulz does anyway.
:func:`exchange_bytes` gives the bytes every rank sends and receives per step for a plan (the figure a parallelism
planner needs); in short, with b bytes per Newton–Schulz element:

- replicated: an all-gather of the orthogonalised blocks, each rank sending and receiving (N-1)·max_r S_r, where
  S_r = b·Σ rows·cols over the blocks rank r owns: about (N-1)/N of the Muon update, once;
- row-sharded: each rank sends and receives b·cols times the rows of blocks cut by a shard boundary that it either
  holds but does not own (inputs out, results back) or owns but does not hold (inputs in, results out), twice;
  nothing for blocks inside a shard. The whole-update all-gather this replaces moved (N-1)/N of every update.
"""

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass(frozen=True)
class Block:
    """Rows ``start:start + rows`` of parameter ``param``'s update viewed as [rows_total, cols]."""

    param: int
    start: int
    rows: int
    cols: int

    @property
    def stop(self) -> int:
        return self.start + self.rows


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` Newton–Schulz iterations on one block; with m, n its short and long sides each
    step multiplies X·Xᵀ (2m²n), (X·Xᵀ)² (2m³) and (...)·X (2m²n)."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m**3)


def row_blocks(param: int, shape: torch.Size, pattern: tuple[int, ...] | None) -> list[Block]:
    """The blocks of one parameter: ``pattern`` (rows of each block of a period, see ``row_pattern``) tiles the rows of
    every matrix of a [..., R, C] parameter; ``None`` makes each matrix one block."""
    cols = shape[-1]
    total = math.prod(shape[:-1])
    sizes = (shape[-2],) if pattern is None else pattern
    blocks, start = [], 0
    while start < total:
        for size in sizes:
            blocks.append(Block(param, start, size, cols))
            start += size
    return blocks


def chunk_row_ranges(shape: torch.Size, world_size: int) -> list[tuple[int, int]]:
    """Flattened rows [lo, hi) each rank holds of a parameter sharded along dim 0 the way ``torch.chunk`` splits it
    (FSDP2 and ``Shard(0)``): ceil(dim0 / N) slices per rank, the last ranks possibly fewer or none."""
    per_rank = -(-shape[0] // world_size)
    inner = math.prod(shape[1:-1])
    return [(min(r * per_rank, shape[0]) * inner, min((r + 1) * per_rank, shape[0]) * inner) for r in range(world_size)]


def assign_blocks(flops: list[int], homes: list[int | None], world_size: int) -> list[int]:
    """Owner rank of every block: its home (the rank holding all its rows) when it has one, otherwise, largest first
    (ties: earlier block), the rank with the fewest FLOPs so far (ties: lower rank). Deterministic."""
    owners = [-1] * len(flops)
    loads = [0] * world_size
    for index, home in enumerate(homes):
        if home is not None:
            owners[index] = home
            loads[home] += flops[index]
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    for index in sorted((i for i, home in enumerate(homes) if home is None), key=lambda i: (-flops[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + flops[index], rank))
    return owners


@dataclass
class ExchangePlan:
    """Blocks of one step's parameters, their owners and (row-sharded) the rows every rank holds.

    ``row_ranges[p][r]`` is the [lo, hi) of parameter p's flattened rows on rank r; ``None`` means replicated.
    """

    blocks: list[Block]
    owners: list[int]
    row_ranges: list[list[tuple[int, int]]] | None
    world_size: int

    def __post_init__(self):
        self._owned = [[] for _ in range(self.world_size)]
        for index, owner in enumerate(self.owners):
            self._owned[owner].append(index)

    def owned(self, rank: int) -> list[int]:
        return self._owned[rank]

    def pieces(self, owner: int, holder: int) -> list[tuple[int, int, int]]:
        """(block, first row, stop row) of every block ``owner`` orthogonalises, cut to the rows ``holder`` keeps, in
        block order: what ``holder`` sends ``owner`` before Newton–Schulz and gets back after it."""
        if self.row_ranges is None:
            return [(index, self.blocks[index].start, self.blocks[index].stop) for index in self.owned(owner)]
        result = []
        for index in self.owned(owner):
            block = self.blocks[index]
            lo, hi = self.row_ranges[block.param][holder]
            first, stop = max(block.start, lo), min(block.stop, hi)
            if first < stop:
                result.append((index, first, stop))
        return result

    def flops_per_rank(self, steps: int) -> list[int]:
        loads = [0] * self.world_size
        for block, owner in zip(self.blocks, self.owners):
            loads[owner] += newton_schulz_flops(block.rows, block.cols, steps)
        return loads


def plan_exchange(shapes, patterns, world_size: int, sharded: bool, steps: int) -> ExchangePlan:
    """The plan for parameters of ``shapes`` (global shapes) with block ``patterns``, replicated or dim-0 sharded."""
    blocks = [block for param, (shape, pattern) in enumerate(zip(shapes, patterns))
              for block in row_blocks(param, shape, pattern)]
    row_ranges = [chunk_row_ranges(shape, world_size) for shape in shapes] if sharded else None
    homes = [None] * len(blocks)
    if sharded:
        for index, block in enumerate(blocks):
            holders = _holders(block, row_ranges)
            homes[index] = holders[0][0] if len(holders) == 1 else None
    flops = [newton_schulz_flops(block.rows, block.cols, steps) for block in blocks]
    return ExchangePlan(blocks, assign_blocks(flops, homes, world_size), row_ranges, world_size)


def _holders(block: Block, row_ranges) -> list[tuple[int, int, int]]:
    """(rank, first row, stop row) of every rank holding rows of ``block``, by binary search over the shard ranges."""
    ranges = row_ranges[block.param]
    rank = bisect.bisect_right([hi for _, hi in ranges], block.start)
    holders = []
    while rank < len(ranges) and ranges[rank][0] < block.stop:
        lo, hi = ranges[rank]
        if max(lo, block.start) < min(hi, block.stop):
            holders.append((rank, max(lo, block.start), min(hi, block.stop)))
        rank += 1
    return holders


def exchange_bytes(plan: ExchangePlan, itemsize: int) -> list[tuple[int, int]]:
    """(bytes sent, bytes received) by every rank in one optimizer step under ``plan``, ``itemsize`` bytes per
    Newton–Schulz element (2 for bf16, 4 for fp32); a rank's copies to itself are not counted.

    Replicated: a ring all-gather of shares padded to the largest, (N-1)·max share each way. Row-sharded: the
    inputs all-to-all plus the results all-to-all, which moves the same rows back.
    """
    size = plan.world_size
    if plan.row_ranges is None:
        largest = max(_share_elements(plan, rank) for rank in range(size))
        return [((size - 1) * largest * itemsize,) * 2 for _ in range(size)]
    moved = [0] * size  # rows of a block travel from each other holder to its owner and back
    for block, owner in zip(plan.blocks, plan.owners):
        for holder, first, stop in _holders(block, plan.row_ranges):
            if holder != owner:
                moved[owner] += (stop - first) * block.cols * itemsize
                moved[holder] += (stop - first) * block.cols * itemsize
    return [(traffic, traffic) for traffic in moved]


def sharded_exchange_bytes(shapes, patterns, world_size: int, steps: int, itemsize: int) -> list[tuple[int, int]]:
    """``exchange_bytes(plan_exchange(shapes, patterns, world_size, True, steps), itemsize)`` without listing every
    block (K3 has about 250,000): only blocks cut by a shard boundary travel, and their owners follow from the FLOPs
    of the uncut blocks, which are counted per rank arithmetically."""
    loads, cut, ranges_of, offset = [0] * world_size, [], {}, 0
    for param, (shape, pattern) in enumerate(zip(shapes, patterns)):
        cols, total = shape[-1], math.prod(shape[:-1])
        sizes = (shape[-2],) if pattern is None else tuple(pattern)
        period, starts = sum(sizes), list(itertools.accumulate(sizes, initial=0))[:-1]
        ranges_of[param] = ranges = chunk_row_ranges(torch.Size(shape), world_size)
        for rank, (lo, hi) in enumerate(ranges):
            for start, size in zip(starts, sizes):  # the blocks start + k·period lying inside [lo, hi)
                first, last = max(0, -((start - lo) // period)), (hi - start - size) // period
                loads[rank] += max(0, last - first + 1) * newton_schulz_flops(size, cols, steps)
        cut_here = {}
        for boundary in {hi for _, hi in ranges if 0 < hi < total}:
            for period_index in (boundary // period - 1, boundary // period):
                for position, (start, size) in enumerate(zip(starts, sizes)):
                    begin = period_index * period + start
                    if begin < boundary < begin + size:
                        cut_here[offset + period_index * len(sizes) + position] = Block(param, begin, size, cols)
        cut += sorted(cut_here.items())
        offset += total // period * len(sizes)
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    moved = [0] * world_size
    for _, block in sorted(cut, key=lambda item: (-newton_schulz_flops(item[1].rows, item[1].cols, steps), item[0])):
        load, owner = heapq.heappop(heap)
        heapq.heappush(heap, (load + newton_schulz_flops(block.rows, block.cols, steps), owner))
        for holder, first, stop in _holders(block, ranges_of):
            if holder != owner:
                moved[owner] += (stop - first) * block.cols * itemsize
                moved[holder] += (stop - first) * block.cols * itemsize
    return [(traffic, traffic) for traffic in moved]


def _elements(plan: ExchangePlan, piece: tuple[int, int, int]) -> int:
    index, first, stop = piece
    return (stop - first) * plan.blocks[index].cols


def _share_elements(plan: ExchangePlan, rank: int) -> int:
    return sum(plan.blocks[index].rows * plan.blocks[index].cols for index in plan.owned(rank))


# ---------------------------------------------------------------------------------------------------------------------
# Where the updates live
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Domain:
    """Parameters whose updates are split over one process group: replicated (``mesh`` None) or row-sharded."""

    group: object
    mesh: object = None

    @property
    def sharded(self) -> bool:
        return self.mesh is not None


def split_domain(update: torch.Tensor) -> Domain | None:
    """Where Newton–Schulz of ``update`` can be split: plain tensors under an initialised process group of several
    ranks are taken as replicated (the DDP contract), a ``DTensor`` sharded along dim 0 over a 1-D mesh as row-sharded;
    ``None`` (this process does every block itself) otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not isinstance(update, DTensor):
        return Domain(dist.group.WORLD) if dist.get_world_size() > 1 else None
    mesh = update.device_mesh
    if mesh.ndim != 1 or mesh.size() < 2 or mesh.mesh.tolist() != sorted(mesh.mesh.tolist()):
        return None
    if update.placements[0] == Shard(0):
        return Domain(mesh.get_group(), mesh)
    if update.placements[0] == Replicate():
        return Domain(mesh.get_group())
    return None


# ---------------------------------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------------------------------
def orthogonalize_split(updates, patterns, dtypes, domain: Domain, plan: ExchangePlan, orthogonalize, ns_dtype,
                        scale_of):
    """Orthogonalised update rows this rank keeps, per parameter: (tensor of the update's local shape, alpha scale).

    ``orthogonalize(stacks)`` is Newton–Schulz on a list of [n, rows, cols] stacks (outputs in ``ns_dtype``);
    ``scale_of(rows, cols)`` the RMS-matching factor of a block. A parameter whose blocks share one factor gets it as
    the returned scale (applied in the final add); otherwise its rows come back in ``dtypes[p]`` already scaled.
    """
    rank = dist.get_rank(domain.group)
    local = [_local(update).reshape(-1, update.shape[-1]) for update in updates]
    device = local[0].device
    owned = plan.owned(rank)
    if domain.sharded:
        inputs = _gather_owned_rows(plan, rank, local, ns_dtype, device, domain.group)
    else:
        inputs = {index: local[plan.blocks[index].param][plan.blocks[index].start:plan.blocks[index].stop]
                  for index in owned}
    outputs = _orthogonalize_blocks(owned, inputs, orthogonalize)
    if domain.sharded:
        rows = _return_held_rows(plan, rank, outputs, ns_dtype, device, domain.group)
    else:
        rows = _all_gather_blocks(plan, rank, outputs, ns_dtype, device, domain.group)
    return _assemble(plan, rank, rows, updates, local, dtypes, scale_of)


def _local(update: torch.Tensor) -> torch.Tensor:
    return update.to_local() if isinstance(update, DTensor) else update


def _gather_owned_rows(plan, rank, local, ns_dtype, device, group):
    """Every block this rank owns, whole, in ``ns_dtype``: its own rows plus the rows the other ranks send."""
    def held_rows(piece):
        index, first, stop = piece
        param = plan.blocks[index].param
        lo = plan.row_ranges[param][rank][0]
        return local[param][first - lo:stop - lo].to(ns_dtype)

    size = plan.world_size
    sends = [[held_rows(piece) for piece in plan.pieces(owner, rank)] if owner != rank else [] for owner in range(size)]
    expected = [plan.pieces(rank, holder) if holder != rank else [] for holder in range(size)]
    received = _all_to_all(sends, expected, plan, ns_dtype, device, group)
    blocks = {}
    for index in plan.owned(rank):
        block = plan.blocks[index]
        blocks[index] = torch.empty(block.rows, block.cols, dtype=ns_dtype, device=device)
    own = plan.pieces(rank, rank)
    for pieces, tensors in [(own, [held_rows(piece) for piece in own]), *zip(expected, received)]:
        for (index, first, stop), rows in zip(pieces, tensors):
            start = plan.blocks[index].start
            blocks[index][first - start:stop - start] = rows
    return blocks


def _orthogonalize_blocks(owned, inputs, orthogonalize):
    """Newton–Schulz on this rank's blocks, batched by shape by ``orthogonalize``."""
    stacks = [inputs[index].unsqueeze(0) for index in owned]
    return {index: output[0] for index, output in zip(owned, orthogonalize(stacks))}


def _return_held_rows(plan, rank, outputs, dtype, device, group):
    """The orthogonalised rows this rank holds: (block, first, stop) -> rows, from its own blocks and the others'."""
    size = plan.world_size

    def owned_rows(piece):
        index, first, stop = piece
        start = plan.blocks[index].start
        return outputs[index][first - start:stop - start]

    sends = [[owned_rows(piece) for piece in plan.pieces(rank, holder)] if holder != rank else []
             for holder in range(size)]
    expected = [plan.pieces(owner, rank) if owner != rank else [] for owner in range(size)]
    received = _all_to_all(sends, expected, plan, dtype, device, group)
    rows = {piece: owned_rows(piece) for piece in plan.pieces(rank, rank)}
    for pieces, tensors in zip(expected, received):
        rows.update(zip(pieces, tensors))
    return rows


def _all_gather_blocks(plan, rank, outputs, dtype, device, group):
    """Every block's orthogonalised rows on every rank: one all-gather of byte shares padded to the largest."""
    size = plan.world_size
    shares = [_share_elements(plan, r) for r in range(size)]
    mine = torch.zeros(max(shares), dtype=dtype, device=device)
    if outputs:
        torch.cat([outputs[index].reshape(-1) for index in plan.owned(rank)], out=mine[:shares[rank]])
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather([_as_bytes(t) for t in gathered], _as_bytes(mine), group=group)
    rows = {}
    for owner, flat in enumerate(gathered):
        offset = 0
        for index, first, stop in plan.pieces(owner, owner):
            block = plan.blocks[index]
            rows[(index, first, stop)] = flat[offset:offset + block.rows * block.cols].view(block.rows, block.cols)
            offset += block.rows * block.cols
    return rows


def _all_to_all(sends, expected, plan, dtype, device, group):
    """One all-to-all of row pieces as raw bytes; returns, per source rank, the received pieces as row tensors."""
    send = [torch.cat([t.reshape(-1) for t in pieces]) if pieces else torch.empty(0, dtype=dtype, device=device)
            for pieces in sends]
    send_bytes = torch.cat([_as_bytes(t) for t in send])
    recv_sizes = [sum(_elements(plan, piece) for piece in pieces) * dtype.itemsize for pieces in expected]
    recv_bytes = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv_bytes, send_bytes, output_split_sizes=recv_sizes,
                           input_split_sizes=[t.numel() * dtype.itemsize for t in send], group=group)
    received = []
    for pieces, chunk in zip(expected, recv_bytes.split(recv_sizes)):
        values = chunk.view(dtype)
        tensors, offset = [], 0
        for index, first, stop in pieces:
            count = (stop - first) * plan.blocks[index].cols
            tensors.append(values[offset:offset + count].view(stop - first, plan.blocks[index].cols))
            offset += count
        received.append(tensors)
    return received


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _assemble(plan, rank, rows, updates, local, dtypes, scale_of):
    """Per parameter, the rows this rank keeps as a tensor of the update's local shape, with the alpha scale."""
    by_param = [[] for _ in updates]
    for (index, first, stop), values in rows.items():
        by_param[plan.blocks[index].param].append((index, first, stop, values))
    scales = [set() for _ in updates]  # over all of a parameter's blocks, held here or not: the same rule everywhere
    for block in plan.blocks:
        scales[block.param].add(scale_of(block.rows, block.cols))
    results = []
    for param, (update, flat) in enumerate(zip(updates, local)):
        pieces = sorted(by_param[param], key=lambda piece: piece[1])
        single = len(scales[param]) == 1
        dtype = pieces[0][3].dtype if single and pieces else dtypes[param]
        merged = torch.empty(flat.shape, dtype=dtype, device=flat.device)
        lo = plan.row_ranges[param][rank][0] if plan.row_ranges is not None else 0
        for index, first, stop, values in pieces:
            block = plan.blocks[index]
            merged[first - lo:stop - lo] = values if single else values.to(dtype) * scale_of(block.rows, block.cols)
        merged = merged.view(_local(update).shape)
        if isinstance(update, DTensor):
            merged = DTensor.from_local(merged, update.device_mesh, update.placements, run_check=False,
                                        shape=update.shape, stride=update.stride())
        results.append((merged, next(iter(scales[param])) if single else 1.0))
    return results
