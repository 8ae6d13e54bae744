"""Newton–Schulz split across ranks: each rank orthogonalises only its share of the Muon blocks.

Without this every rank of a data-parallel run orthogonalises every block of every parameter, and N-1 of every N
Newton–Schulz FLOPs are thrown away; under FSDP2 or expert parallelism every rank would also gather every update
whole. The scheme, for one optimizer step over the N ranks of a process group:

1. **Plan** (cached while the parameters keep their shapes and layouts). Every rank lists the same blocks in the
   same order (parameters in optimizer order, then rows; a block is ``rows`` consecutive rows of the update viewed as
   [rows, cols]) and gives each one owner: a block that one rank holds whole is that rank's (its home), the others go,
   largest first (ties: earlier block), to the rank with the fewest Newton–Schulz FLOPs so far (ties: lower rank).
   The plan is a pure function of the shapes and layouts, so it needs no communication and is the same everywhere.
2. **Replicated parameters** (DDP, or anything else that is the same on every rank, :class:`ReplicatedPlan`): every
   rank holds every block, none has a home; each rank orthogonalises its own, and one all-gather (each share padded
   to the largest) hands every rank every block.
3. **Sharded parameters** (``DTensor`` layouts :mod:`kimi_k3.parallel.shard_layout` describes, :class:`ShardedPlan`: FSDP2's
   ``Shard(0)``, expert parallelism's 2-D (efsdp, ep) mesh, tensor parallelism's row and column splits): a block
   inside one rank's shard (every expert matrix under expert parallelism, most head blocks under FSDP2) is
   orthogonalised where it lies and never travels. For the blocks cut by a shard boundary one all-to-all sends each
   owner the pieces the other ranks hold, Newton–Schulz runs on whole blocks, and a second all-to-all returns every
   piece to its holder. Only the home blocks' FLOPs and elements are counted per rank, arithmetically, so a plan of
   the released model (275,000 blocks over hundreds of ranks) takes a few seconds.
4. Every rank applies the rows it keeps. Newton–Schulz of one block does not depend on the other blocks batched with
   it (:mod:`kimi_k3.optim.newton_schulz` makes every call the same shape), and the transport moves raw bytes, so every
   rank ends the step with bitwise the single-process update.

:mod:`kimi_k3.optim.newton_schulz_exchange` runs a step of a plan. Inputs travel already cast to the Newton–Schulz dtype,
the first thing Newton–Schulz does anyway. A plan's ``exchange_bytes(itemsize)`` gives the bytes every rank sends and
receives per step (the figure a parallelism planner needs); with b bytes per Newton–Schulz element:

- replicated: an all-gather of the orthogonalised blocks, each rank sending and receiving (N-1)·max_r S_r, where
  S_r = b·Σ rows·cols over the blocks rank r owns: about (N-1)/N of the Muon update, once;
- sharded: each rank sends and receives b times the elements of the pieces of cut blocks that it holds but does not
  own (inputs out, results back) or owns but does not hold (inputs in, results out); nothing for blocks inside a
  shard. The whole-update all-gather this replaces moved (N-1)/N of every update.
"""

import bisect
import functools
import heapq
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from kimi_k3.optim.newton_schulz import newton_schulz_flops, queue_flops
from kimi_k3.parallel.shard_layout import Holding, LayoutError, check_placements, dtensor_holdings, matrix_shape, mesh_holdings


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


def block_sizes(shape, pattern: tuple[int, ...] | None) -> tuple[int, ...]:
    """Rows of each block of a period: ``pattern`` (``row_pattern`` of the parameter's group), or one whole matrix."""
    return (shape[-2],) if pattern is None else tuple(pattern)


def row_blocks(param: int, shape: torch.Size, pattern: tuple[int, ...] | None) -> list[Block]:
    """The blocks of one parameter: ``pattern`` (rows of each block of a period, see ``row_pattern``) tiles the rows of
    every matrix of a [..., R, C] parameter; ``None`` makes each matrix one block."""
    rows, cols = matrix_shape(shape)
    sizes = block_sizes(shape, pattern)
    blocks, start = [], 0
    while start < rows:
        for size in sizes:
            blocks.append(Block(param, start, size, cols))
            start += size
    return blocks


def assign_blocks(flops: list[int], homes: list[int | None], world_size: int) -> list[int]:
    """Owner rank of every block: its home (the rank holding all its rows) when it has one, otherwise, largest first
    (ties: earlier block), the rank with the fewest FLOPs so far (ties: lower rank). Deterministic."""
    loads = [0] * world_size
    for index, home in enumerate(homes):
        if home is not None:
            loads[home] += flops[index]
    owners = [home if home is not None else -1 for home in homes]
    unowned = [index for index, home in enumerate(homes) if home is None]
    for index, owner in zip(unowned, _least_loaded(loads, [flops[i] for i in unowned])):
        owners[index] = owner
    return owners


def _least_loaded(loads: list[int], flops: list[int]) -> list[int]:
    """Greedy owners of blocks of ``flops`` (in that order of ties) over ranks already carrying ``loads``."""
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    owners = [-1] * len(flops)
    for index in sorted(range(len(flops)), key=lambda i: (-flops[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + flops[index], rank))
    return owners


# ---------------------------------------------------------------------------------------------------------------------
# Replicated parameters (DDP)
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class ReplicatedPlan:
    """Every block of one step's replicated parameters and its owner."""

    blocks: list[Block]
    owners: list[int]
    world_size: int
    steps: int

    def __post_init__(self):
        self._owned = [[] for _ in range(self.world_size)]
        for index, owner in enumerate(self.owners):
            self._owned[owner].append(index)

    @property
    def block_count(self) -> int:
        return len(self.blocks)

    def owned(self, rank: int) -> list[int]:
        return self._owned[rank]

    def share_elements(self, rank: int) -> int:
        return sum(self.blocks[index].rows * self.blocks[index].cols for index in self.owned(rank))

    def flops_per_rank(self) -> list[int]:
        loads = [0] * self.world_size
        for block, owner in zip(self.blocks, self.owners):
            loads[owner] += newton_schulz_flops(block.rows, block.cols, self.steps)
        return loads

    def call_flops(self, rank: int) -> int:
        """Matmul FLOPs of ``rank``'s Newton–Schulz calls: its blocks in whole chunks (:func:`queue_flops`)."""
        return queue_flops([(self.blocks[index].rows, self.blocks[index].cols) for index in self.owned(rank)],
                           self.steps)

    def exchange_bytes(self, itemsize: int) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) per rank: a ring all-gather of shares padded to the largest."""
        largest = max(self.share_elements(rank) for rank in range(self.world_size))
        return [((self.world_size - 1) * largest * itemsize,) * 2 for _ in range(self.world_size)]


def plan_replicated(shapes, patterns, world_size: int, steps: int) -> ReplicatedPlan:
    blocks = [block for param, (shape, pattern) in enumerate(zip(shapes, patterns))
              for block in row_blocks(param, shape, pattern)]
    flops = [newton_schulz_flops(block.rows, block.cols, steps) for block in blocks]
    return ReplicatedPlan(blocks, assign_blocks(flops, [None] * len(blocks), world_size), world_size, steps)


# ---------------------------------------------------------------------------------------------------------------------
# Sharded parameters
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tiling:
    """How one parameter's blocks tile its [rows, cols] matrix view: periods of blocks of ``sizes`` rows, down the rows.
    Block ``number`` is block ``number % len(sizes)`` of period ``number // len(sizes)``."""

    sizes: tuple[int, ...]
    rows: int
    cols: int

    @classmethod
    def of(cls, shape, pattern) -> "Tiling":
        return cls(block_sizes(shape, pattern), *matrix_shape(shape))

    @property
    def period(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        return tuple(sum(self.sizes[:position]) for position in range(len(self.sizes)))

    @property
    def periods(self) -> int:
        return self.rows // self.period

    def block(self, number: int) -> tuple[int, int]:
        """(first row, rows) of block ``number``."""
        period, position = divmod(number, len(self.sizes))
        return period * self.period + self.starts[position], self.sizes[position]

    def inside(self, lo: int, hi: int) -> list[range]:
        """Per position of the period, the period indices whose block lies wholly inside rows [lo, hi)."""
        ranges = []
        for start, size in zip(self.starts, self.sizes):
            first = max(0, -((start - lo) // self.period))
            last = min(self.periods - 1, (hi - start - size) // self.period)
            ranges.append(range(first, max(first, last + 1)))
        return ranges

    def blocks_inside(self, lo: int, hi: int) -> list[int]:
        """Numbers of the blocks lying wholly inside rows [lo, hi), in order."""
        width = len(self.sizes)
        return sorted(period * width + position for position, periods in enumerate(self.inside(lo, hi))
                      for period in periods)

    def straddling(self, boundary: int) -> list[int]:
        """Numbers of the blocks with rows on both sides of ``boundary``."""
        numbers = []
        for position, (start, size) in enumerate(zip(self.starts, self.sizes)):
            period = (boundary - 1 - start) // self.period
            begin = period * self.period + start
            if 0 <= period < self.periods and begin < boundary < begin + size:
                numbers.append(period * len(self.sizes) + position)
        return numbers


class Piece(NamedTuple):
    """The rectangle rows [row_start, row_stop) x cols [col_start, col_stop) of a block that rank ``rank`` holds."""

    rank: int
    row_start: int
    row_stop: int
    col_start: int
    col_stop: int

    @property
    def numel(self) -> int:
        return (self.row_stop - self.row_start) * (self.col_stop - self.col_start)


@dataclass(frozen=True)
class ParamExchange:
    """One parameter under one layout: per rank the FLOPs and elements of the blocks it holds whole (its home blocks)
    and of its pieces of the other blocks, and those blocks, cut by a shard boundary, as (block number, the pieces the
    ranks hold of it)."""

    home_flops: tuple[int, ...]
    home_elements: tuple[int, ...]
    cut: tuple[tuple[int, tuple[Piece, ...]], ...]
    held_cut_elements: tuple[int, ...]


def param_exchange(tiling: Tiling, holdings: tuple[Holding, ...], steps: int) -> ParamExchange:
    """The home blocks and cut blocks of a parameter of ``tiling`` whose ranks hold ``holdings``."""
    flops = [newton_schulz_flops(size, tiling.cols, steps) for size in tiling.sizes]
    home_flops, home_elements = [0] * len(holdings), [0] * len(holdings)
    for rank, holding in enumerate(holdings):
        if holding.numel and holding.holds_all_columns(tiling.cols):
            for lo, hi in holding.rows:
                for position, periods in enumerate(tiling.inside(lo, hi)):
                    home_flops[rank] += len(periods) * flops[position]
                    home_elements[rank] += len(periods) * tiling.sizes[position] * tiling.cols
    whole_columns = [holding.holds_all_columns(tiling.cols) for holding in holdings if holding.numel]
    if all(whole_columns):
        edges = {edge for holding in holdings for run in holding.rows for edge in run if 0 < edge < tiling.rows}
        numbers = sorted({number for edge in edges for number in tiling.straddling(edge)})
    elif not any(whole_columns):
        numbers = range(tiling.periods * len(tiling.sizes))
    else:
        raise LayoutError("some ranks hold whole rows of it and others parts of rows")
    locate = _piece_locator(holdings)
    cut = tuple((number, locate(*tiling.block(number))) for number in numbers)
    held = [0] * len(holdings)
    for _, pieces in cut:
        for piece in pieces:
            held[piece.rank] += piece.numel
    return ParamExchange(tuple(home_flops), tuple(home_elements), cut, tuple(held))


def _piece_locator(holdings: tuple[Holding, ...]):
    """A function (first row, rows) -> the pieces of that block each rank holds, in (rank, row, column) order."""
    edges = sorted({edge for holding in holdings for run in holding.rows for edge in run})
    covering = [[] for _ in edges]
    for rank, holding in enumerate(holdings):
        for lo, hi in holding.rows if holding.cols else ():
            for segment in range(bisect.bisect_left(edges, lo), bisect.bisect_left(edges, hi)):
                covering[segment].append(rank)

    def pieces(start: int, rows: int) -> tuple[Piece, ...]:
        found = []
        for segment in range(bisect.bisect_right(edges, start) - 1, bisect.bisect_left(edges, start + rows)):
            first, stop = max(start, edges[segment]), min(start + rows, edges[segment + 1])
            for rank in covering[segment]:
                found += [Piece(rank, first, stop, lo, hi) for lo, hi in holdings[rank].cols]
        merged = []
        for piece in sorted(found):
            last = merged[-1] if merged else None
            if last and (last.rank, last.row_stop, last.col_start) == (piece.rank, piece.row_start, piece.col_start):
                merged[-1] = last._replace(row_stop=piece.row_stop)
            else:
                merged.append(piece)
        return tuple(merged)

    return pieces


class RankView(NamedTuple):
    """What one rank does in a step of a :class:`ShardedPlan`; pieces are (cut block, piece) index pairs."""

    owned: list[int]  # cut blocks this rank orthogonalises
    outgoing: list[list[tuple[int, int]]]  # per owner: pieces this rank holds of that owner's blocks
    incoming: list[list[tuple[int, int]]]  # per holder: pieces that rank holds of this rank's blocks
    held: list[list[tuple[int, int]]]  # per parameter: pieces this rank holds of its cut blocks


class ShardedPlan:
    """The blocks of one step's sharded parameters: home blocks counted per rank, cut blocks listed with owners.

    ``holdings[p][r]`` is what rank r of the group holds of parameter p (:class:`kimi_k3.parallel.shard_layout.Holding`).
    Parameters of one tiling given the same ``holdings`` object share one analysis.
    """

    def __init__(self, tilings: list[Tiling], holdings: list[tuple[Holding, ...]], steps: int):
        self.tilings, self.holdings, self.steps = tilings, holdings, steps
        self.world_size = len(holdings[0]) if holdings else 1
        analyses = {}
        for tiling, held in zip(tilings, holdings):
            if (tiling, id(held)) not in analyses:
                analyses[tiling, id(held)] = param_exchange(tiling, held, steps)
        self.params = [analyses[tiling, id(held)] for tiling, held in zip(tilings, holdings)]
        self.home_flops = [sum(param.home_flops[rank] for param in self.params) for rank in range(self.world_size)]
        self.cut = [(index, number, pieces) for index, param in enumerate(self.params) for number, pieces in param.cut]
        self.cut_flops = [newton_schulz_flops(self.cut_block(i)[1], self.tilings[p].cols, steps)
                          for i, (p, _, _) in enumerate(self.cut)]
        self.cut_owners = _least_loaded(self.home_flops, self.cut_flops)
        self._views = {}

    def cut_block(self, index: int) -> tuple[int, int]:
        """(first row, rows) of cut block ``index``."""
        param, number, _ = self.cut[index]
        return self.tilings[param].block(number)

    @property
    def block_count(self) -> int:
        return sum(tiling.periods * len(tiling.sizes) for tiling in self.tilings)

    def flops_per_rank(self) -> list[int]:
        loads = list(self.home_flops)
        for owner, flops in zip(self.cut_owners, self.cut_flops):
            loads[owner] += flops
        return loads

    def call_flops(self, rank: int) -> int:
        """Matmul FLOPs of ``rank``'s Newton–Schulz calls: the cut blocks it owns, then the home blocks of every
        parameter, each in whole chunks (:func:`queue_flops`)."""
        cut = [(self.cut_block(index)[1], self.tilings[self.cut[index][0]].cols) for index in self.view(rank).owned]
        home = [(size, tiling.cols) for param, tiling in enumerate(self.tilings)
                for _, size in self.home_blocks(param, rank)]
        return queue_flops(cut, self.steps) + queue_flops(home, self.steps)

    def cut_elements(self) -> dict[str, list[int]]:
        """Per rank, elements of the cut blocks: ``held`` (its pieces of them), ``sent`` (its pieces of blocks others
        own, which it sends as inputs and gets back), ``received`` (the others' pieces of the blocks it owns) and
        ``owned`` (the blocks it orthogonalises)."""
        held = ([sum(column) for column in zip(*(param.held_cut_elements for param in self.params))] if self.params
                else [0] * self.world_size)
        own_pieces, owned = [0] * self.world_size, [0] * self.world_size
        for index, ((_, _, pieces), owner) in enumerate(zip(self.cut, self.cut_owners)):
            owned[owner] += self.cut_block(index)[1] * self.tilings[self.cut[index][0]].cols
            first = bisect.bisect_left(pieces, (owner,))
            own_pieces[owner] += sum(piece.numel for piece in itertools.takewhile(lambda p: p.rank == owner,
                                                                                   pieces[first:]))
        return {"held": held, "sent": [h - o for h, o in zip(held, own_pieces)],
                "received": [total - o for total, o in zip(owned, own_pieces)], "owned": owned}

    def moved_elements(self) -> list[int]:
        """Per rank, the elements of cut-block pieces it sends in the two all-to-alls (= the elements it receives)."""
        counts = self.cut_elements()
        return [sent + received for sent, received in zip(counts["sent"], counts["received"])]

    def exchange_bytes(self, itemsize: int) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) per rank: the inputs all-to-all plus the results all-to-all."""
        return [(moved * itemsize,) * 2 for moved in self.moved_elements()]

    def view(self, rank: int) -> RankView:
        if rank not in self._views:
            view = RankView([], [[] for _ in range(self.world_size)], [[] for _ in range(self.world_size)],
                            [[] for _ in self.params])
            for index, ((param, _, pieces), owner) in enumerate(zip(self.cut, self.cut_owners)):
                if owner == rank:
                    view.owned.append(index)
                for number, piece in enumerate(pieces):
                    if piece.rank == rank:
                        view.held[param].append((index, number))
                        if owner != rank:
                            view.outgoing[owner].append((index, number))
                    elif owner == rank:
                        view.incoming[piece.rank].append((index, number))
            self._views[rank] = view
        return self._views[rank]

    def piece(self, pair: tuple[int, int]) -> Piece:
        return self.cut[pair[0]][2][pair[1]]

    def home_blocks(self, param: int, rank: int) -> list[tuple[int, int]]:
        """(local first row, rows) of every block of ``param`` that ``rank`` holds whole, in order."""
        tiling, holding = self.tilings[param], self.holdings[param][rank]
        if not holding.numel or not holding.holds_all_columns(tiling.cols):
            return []
        blocks = []
        for lo, hi in holding.rows:
            for number in tiling.blocks_inside(lo, hi):
                start, size = tiling.block(number)
                blocks.append((holding.row_slice(start, start + size).start, size))
        return blocks


def plan_sharded(shapes, patterns, holdings, steps: int) -> ShardedPlan:
    return ShardedPlan([Tiling.of(shape, pattern) for shape, pattern in zip(shapes, patterns)], list(holdings), steps)


def fsdp_holdings(shape, world_size: int) -> tuple[Holding, ...]:
    """What each of ``world_size`` ranks holds of a tensor sharded along dim 0 (FSDP2, ``Shard(0)``)."""
    by_rank = mesh_holdings(tuple(shape), (world_size,), tuple(range(world_size)), (Shard(0),))
    return tuple(by_rank[rank] for rank in range(world_size))


def plan_exchange(shapes, patterns, world_size: int, sharded: bool, steps: int):
    """The plan of parameters of global ``shapes`` with block ``patterns``, replicated (DDP) or FSDP2-sharded along
    dim 0 over ``world_size`` ranks."""
    if sharded:
        return plan_sharded(shapes, patterns, [fsdp_holdings(shape, world_size) for shape in shapes], steps)
    return plan_replicated(shapes, patterns, world_size, steps)


# ---------------------------------------------------------------------------------------------------------------------
# Where the updates live
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Domain:
    """Parameters whose Newton–Schulz is split over one process group: replicated, or sharded (DTensor layouts)."""

    group: object
    sharded: bool


def split_domain(tensor: torch.Tensor) -> Domain | None:
    """Where Newton–Schulz of ``tensor`` (a parameter) is split: plain tensors under an initialised process group of
    several ranks are taken as replicated (the DDP contract), a ``DTensor`` as sharded over its mesh (or replicated when
    every placement is ``Replicate``); ``None`` (this process does every block) without a process group. Raises
    :class:`LayoutError` for a mesh or placement the split cannot describe."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if not isinstance(tensor, DTensor):
        return Domain(dist.group.WORLD, sharded=False) if world > 1 else None
    mesh = tensor.device_mesh
    replicated = all(isinstance(placement, Replicate) for placement in tensor.placements)
    if replicated and mesh.size() < 2:
        return None
    check_placements(tensor.placements, tuple(mesh.mesh.shape))
    if sorted(mesh.mesh.flatten().tolist()) == list(range(world)):
        group = dist.group.WORLD
    elif mesh.ndim == 1:
        group = mesh.get_group()
    else:
        raise LayoutError(f"its {mesh.ndim}-D mesh holds {mesh.size()} of the {world} ranks")
    return Domain(group, sharded=not replicated)


def group_holdings(tensor: DTensor, group) -> tuple[Holding, ...]:
    """What every rank of ``group`` (in group-rank order) holds of a sharded ``tensor``."""
    by_global_rank = dtensor_holdings(tensor)
    return tuple(by_global_rank[dist.get_global_rank(group, rank)] for rank in range(dist.get_world_size(group)))
