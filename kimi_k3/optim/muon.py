"""Per-Head Muon: Muon whose Newton–Schulz step runs on per-head row blocks of the attention projections.

Muon (Keller Jordan's Muon; Moonlight, arXiv:2502.16982) for matrix parameters, AdamW for everything else, in one ``torch.optim.Optimizer`` whose
param groups carry their own ``lr``/``weight_decay``, so one Hugging Face LR schedule drives both halves.

A Muon group may tag its parameters with

- ``head_rows``: the rows of one attention head, an int or a tuple (e.g. ``(k_nope, v)`` for MLA's fused
  ``kv_b_proj``); every head segment is orthogonalized as its own block (Per-Head Muon, K3 report §2.5);
- ``expert_rows``: for stacked expert tensors ``[E, R, C]``, the rows of one block of each expert's matrix
  (``moe_intermediate_size`` splits the fused ``gate_up_proj`` into the released w1 and w3; ``R`` keeps
  ``down_proj`` whole).

Blocks of one shape, of every parameter, share batched Newton–Schulz calls (:mod:`kimi_k3.optim.newton_schulz`: each
call a fixed number of blocks, so that a block's result depends on that block alone).

Under torch.distributed, Newton–Schulz is split across the ranks (:mod:`kimi_k3.optim.split_newton_schulz`): each rank
orthogonalises about 1/N of the blocks and the results are exchanged, for replicated (DDP) parameters and for
``DTensor`` shards (FSDP2, expert parallelism's 2-D mesh, tensor parallelism), where a block inside a rank's shard
(every expert matrix under expert parallelism) is orthogonalised there and only blocks cut by a shard boundary
travel. Momentum, decay and AdamW are elementwise and run on the shards as they are. Every rank ends the step with
bitwise the single-process update. :func:`newton_schulz_exchange_bytes` is the per-step communication of that scheme.
"""

import functools
import itertools
import math
import re
from collections import defaultdict
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw

from checkpoint_format_kimi_k3 import EXPERT_LAYOUT, expert_block_rows
from variants_kimi_k3 import BASIS_OF_EXPERT_TENSOR
from kimi_k3.optim.newton_schulz import (
    NS_STEPS,
    NewtonSchulzQueue,
    orthogonalize_by_shape,
)
from kimi_k3.optim import elementwise
from kimi_k3.optim.precision import matmul_dtype
from kimi_k3.parallel.shard_layout import LayoutError, check_local_shard
from kimi_k3.optim.newton_schulz_exchange import CutBlockExchange, HomeBlocks, orthogonalize_replicated
from kimi_k3.optim.split_newton_schulz import (
    Domain,
    ShardedPlan,
    Tiling,
    group_holdings,
    plan_exchange,
    plan_replicated,
    split_domain,
)

# Moonlight update-RMS matching: 0.2·sqrt(max(rows, cols)) gives an AdamW-like update RMS of ~0.2 (Moonlight, arXiv:2502.16982).
MATCH_RMS_ADAMW = 0.2

_KDA_HEAD_PROJS = ("q_proj", "k_proj", "v_proj")
_MLA_QUERY_PROJS = ("q_b_proj", "q_proj")
LAYER_PARAM = re.compile(r"layers\.(\d+)\.self_attn\.(\w+)\.weight$")
# The vision tower's fused q/k/v projection: 3 x heads row blocks of head_dim (its output projection, MLP and the
# projector are whole matrices).
VISION_QKV_PARAM = re.compile(r"vision_tower\.encoder\.blocks\.\d+\.wqkv\.weight$")


def row_pattern(group):
    """Rows of one block, repeated along the rows of every matrix of ``group`` (one entry per block of a head)."""
    rows = group["head_rows"] if group.get("head_rows") is not None else group.get("expert_rows")
    return (rows,) if isinstance(rows, int) else rows


def split_row_blocks(matrices, pattern):
    """View ``matrices`` [..., R, C] as block stacks [n, r, C], one stack per distinct segment of ``pattern``."""
    rows, cols = matrices.shape[-2:]
    if pattern is None:
        return [matrices.reshape(-1, rows, cols)]
    if len(set(pattern)) == 1:
        return [matrices.reshape(-1, pattern[0], cols)]
    periods = matrices.reshape(-1, sum(pattern), cols)
    starts = itertools.accumulate(pattern, initial=0)
    return [periods[:, start : start + size] for start, size in zip(starts, pattern)]


def merge_row_blocks(blocks, pattern, shape):
    """Inverse of :func:`split_row_blocks`."""
    if len(blocks) == 1:
        return blocks[0].reshape(shape)
    merged = torch.empty(shape, dtype=blocks[0].dtype, device=blocks[0].device)
    periods = merged.view(-1, sum(pattern), shape[-1])
    for start, size, block in zip(itertools.accumulate(pattern, initial=0), pattern, blocks):
        periods[:, start : start + size] = block
    return merged


def gather_whole_matrix(update):
    """A sharded (``DTensor``) update all-gathered into a whole plain tensor on every rank; a plain tensor as it is.

    The path of ``split_newton_schulz=False``: every rank orthogonalises every block of every update, then keeps its
    own shard of the result (:func:`shard_like`). Bitwise the single-process update.
    """
    return update.full_tensor() if isinstance(update, DTensor) else update


def shard_layout(update):
    """(mesh, placements) of a sharded (``DTensor``) update, None for a plain one: what :func:`shard_like` needs."""
    return (update.device_mesh, update.placements) if isinstance(update, DTensor) else None


def shard_like(layout, whole):
    """This rank's shard of ``whole`` in ``layout`` (:func:`shard_layout`; local slicing, no communication)."""
    if layout is None:
        return whole
    return distribute_tensor(whole, *layout, src_data_rank=None)


def newton_schulz_exchange_bytes(shapes, patterns, world_size, sharded, itemsize=torch.bfloat16.itemsize):
    """(bytes sent, bytes received) per rank and optimizer step by split Newton–Schulz, for Muon parameters of global
    ``shapes`` with block ``patterns`` (``row_pattern`` of their groups; None = whole matrices), replicated (DDP)
    or dim-0 sharded (FSDP2) over ``world_size`` ranks. See :mod:`kimi_k3.optim.split_newton_schulz` for the scheme and for
    other layouts (``ShardedPlan``). ``itemsize`` is that of the optimizer's ``ns_dtype``: bf16 (2) by default, fp32 (4)
    where bf16 is emulated."""
    return plan_exchange(shapes, patterns, world_size, sharded, NS_STEPS).exchange_bytes(itemsize)


class MuonJob(NamedTuple):
    """One Muon parameter of a step, with its group, block pattern and name (for error messages)."""

    param: torch.Tensor
    group: dict
    pattern: tuple[int, ...] | None
    name: str


def muon_shapes_and_patterns(param_groups):
    """Global shapes and block patterns of every Muon parameter of ``param_groups`` (an optimizer's, or those of
    :func:`build_param_groups`), in step order: the arguments of :func:`newton_schulz_exchange_bytes`."""
    pairs = [(tuple(p.shape), row_pattern(group)) for group in param_groups if group.get("use_muon", True)
             for p in group["params"]]
    return [shape for shape, _ in pairs], [pattern for _, pattern in pairs]


class PerHeadMuon(torch.optim.Optimizer):
    """Muon with per-head Newton–Schulz for groups with ``use_muon=True``, AdamW for the other groups.

    Muon update per block B of shape (r, C) (Moonlight's Muon, per head as in K3 report §2.5)::

        M <- mu*M + G ;  U = G + mu*M (Nesterov) ;  W <- W*(1 - lr*wd) - lr*0.2*sqrt(max(r, C))*NS5(U_B)

    Momentum and decay are elementwise, so the state is one buffer per parameter, exactly as for whole-matrix Muon.
    AdamW groups use ``betas``/``eps`` and torch's AdamW arithmetic. Parameters may be FSDP2 ``DTensor`` shards (from
    ``accelerate``'s FSDP2 plugin or transformers' load-time sharding); the update is the same. Policies that act
    after a step (QK-Clip, Quantile Balancing) attach to it as to any optimizer, through its step hooks.

    ``ns_dtype`` is the Newton–Schulz precision: ``"auto"`` (default) runs bf16 where the parameters' device
    multiplies bf16 natively (CUDA, CPUs with AVX-512-BF16 or AMX) and fp32 elsewhere, where emulated bf16 would
    be an order of magnitude slower or worse (`kimi_k3.optim.precision`); ``"bfloat16"`` or ``"float32"`` force one.

    Under an initialised process group of several ranks Newton–Schulz is split across the ranks
    (:mod:`kimi_k3.optim.split_newton_schulz`), with plain parameters taken as replicated, as DDP keeps them, and DTensors
    by their layout (FSDP2, expert and tensor parallelism); a layout it cannot describe is refused at the first step,
    naming the parameter. ``split_newton_schulz=False`` makes every rank gather and orthogonalise every block instead
    (e.g. for parameters that differ between ranks). A single process is unaffected.
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, betas=(0.9, 0.95),
                 eps=1e-8, ns_dtype="auto", split_newton_schulz=True):
        if lr < 0:
            raise ValueError(f"`lr` must be >= 0, got {lr}.")
        if weight_decay < 0:
            raise ValueError(f"`weight_decay` must be >= 0, got {weight_decay}.")
        if not 0 <= momentum < 1:
            raise ValueError(f"`momentum` must be in [0, 1), got {momentum}.")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, betas=betas, eps=eps,
                        use_muon=True, head_rows=None, expert_rows=None)
        super().__init__(params, defaults)
        first_param = next(p for group in self.param_groups for p in group["params"])
        self.ns_dtype = matmul_dtype(ns_dtype, first_param.device)
        self.split_newton_schulz = split_newton_schulz
        self._plans: dict[tuple, object] = {}

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    @classmethod
    def for_model(cls, model, lr=1e-3, weight_decay=0.1, adamw_lr=None, adamw_betas=(0.9, 0.95), adamw_eps=1e-8,
                  momentum=0.95, nesterov=True, split_kv=True, ns_dtype="auto", split_newton_schulz=True,
                  per_head=True):
        """Build the optimizer for a Kimi K3 model with the parameter split of `build_param_groups`.

        ``adamw_lr`` defaults to ``lr``: Moonlight RMS matching makes one lr fit both halves. ``split_kv=True``
        (default) orthogonalizes MLA ``kv_b_proj`` as separate K and V blocks per head, because the report
        orthogonalizes "Q, K and V" as separate projections; a fused [k_nope‖v] block would couple K's and V's
        scales through one Frobenius normalization, which is the coupling Per-Head Muon removes, and QK-Clip
        rescales the K rows alone. ``per_head=False`` is plain Muon on the attention projections: each Q, K, V (MLA's
        fused kv_b_proj included) orthogonalised as one whole matrix, the baseline Per-Head Muon is compared with.
        """
        _refuse_lora_adapters(model)
        groups = build_param_groups(model, weight_decay=weight_decay, adamw_lr=adamw_lr, split_kv=split_kv,
                                    per_head=per_head)
        return cls(groups, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                   betas=adamw_betas, eps=adamw_eps, ns_dtype=ns_dtype, split_newton_schulz=split_newton_schulz)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step([group for group in self.param_groups if group["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group)
        return loss

    def _muon_step(self, groups):
        jobs = [MuonJob(p, group, row_pattern(group), name) for group in groups
                for p, name in zip(group["params"], _param_names(group)) if p.grad is not None]
        by_domain = defaultdict(list)
        for job in jobs:
            by_domain[self._domain(job)].append(job)
        for domain, members in by_domain.items():
            if domain is None:
                self._local_step(members)
            elif domain.sharded:
                self._sharded_step(domain, members)
            else:
                self._replicated_step(domain, members)

    def _domain(self, job) -> Domain | None:
        """Where the job's Newton–Schulz runs; a layout the split cannot describe is refused, naming the parameter."""
        if not self.split_newton_schulz:
            return None
        try:
            return split_domain(job.param)
        except LayoutError as error:
            raise ValueError(f"Per-Head Muon cannot split Newton–Schulz of {_describe(job)}: {error}; pass "
                             "split_newton_schulz=False to orthogonalise whole matrices on every rank.") from None

    def _local_step(self, jobs):
        """Every block on this process (one process, or ``split_newton_schulz=False``), one parameter's update at a
        time: its blocks join the queue's chunks, and the parameter is updated as soon as its last block is done, so a
        step holds about one update besides the blocks waiting for a chunk."""
        queue = NewtonSchulzQueue(self.ns_dtype)
        for job in jobs:
            update = self._momentum_and_update(job)
            whole = gather_whole_matrix(update)
            queue.submit(split_row_blocks(whole, job.pattern),
                         functools.partial(self._apply_whole, job, shard_layout(update), whole.shape))
        queue.flush()

    def _apply_whole(self, job, layout, shape, blocks):
        scales = {_match_rms_scale(block) for block in blocks}
        if len(scales) == 1:  # one scale for all blocks: it goes into the fp32 add, no scaled copies
            scale = scales.pop()
        else:
            blocks, scale = [block.to(job.param.dtype) * _match_rms_scale(block) for block in blocks], 1.0
        self._apply(job, shard_like(layout, merge_row_blocks(blocks, job.pattern, shape)), scale)

    def _replicated_step(self, domain, jobs):
        """Every update of the step at hand, split over the replicated ranks of ``domain``."""
        updates = [self._momentum_and_update(job) for job in jobs]
        patterns, dtypes = [job.pattern for job in jobs], [job.param.dtype for job in jobs]
        key = (domain, tuple(tuple(update.shape) for update in updates), tuple(patterns))
        if key not in self._plans:
            _check_replicated(updates, domain.group)
            world_size = dist.get_world_size(domain.group)
            self._plans[key] = plan_replicated([u.shape for u in updates], patterns, world_size, NS_STEPS)
        orthogonalize = functools.partial(orthogonalize_by_shape, dtype=self.ns_dtype)
        results = orthogonalize_replicated(updates, patterns, dtypes, domain.group, self._plans[key], orthogonalize,
                                           self.ns_dtype, _match_rms_scale_of_shape)
        for job, (update, scale) in zip(jobs, results):
            self._apply(job, update, scale)

    def _sharded_step(self, domain, jobs):
        """Momentum first; then each update is formed twice, once for the pieces of cut blocks that travel and once for
        this rank's own rows. The home blocks of every parameter share Newton–Schulz calls through one queue, and a
        parameter is updated as soon as its last block is done, so a step holds about one parameter's update at a time
        besides those pieces."""
        plan = self._sharded_plan(domain, jobs)
        rank = dist.get_rank(domain.group)
        buffers = [self._advance_momentum(job) for job in jobs]
        orthogonalize = functools.partial(orthogonalize_by_shape, dtype=self.ns_dtype)
        exchange = CutBlockExchange(plan, rank, self.ns_dtype, jobs[0].param.device)
        for index, (job, buffer) in enumerate(zip(jobs, buffers)):
            if exchange.holds_cut_pieces(index):
                exchange.take(index, _local_matrix(self._nesterov_update(job.param, job.group, buffer)))
        results = exchange.run(orthogonalize, domain.group)
        queue = NewtonSchulzQueue(self.ns_dtype)
        for index, (job, buffer) in enumerate(zip(jobs, buffers)):
            update = self._nesterov_update(job.param, job.group, buffer)
            home = HomeBlocks(plan, rank, index, update)
            queue.submit(home.stacks(update), functools.partial(self._apply_assembled, job, home, results))
        queue.flush()

    def _apply_assembled(self, job, home, results, outputs):
        self._apply(job, *home.assemble(outputs, results, job.param.dtype, self.ns_dtype, _match_rms_scale_of_shape))

    def _sharded_plan(self, domain, jobs) -> ShardedPlan:
        """The block assignment of ``domain`` for these parameters' shapes and layouts, computed once (every rank
        computes the same); on that first step each rank checks that the shard it computed for itself is its own."""
        layouts = [(tuple(job.param.shape), job.param.device_mesh, job.param.placements) for job in jobs]
        key = (domain, tuple(layouts), tuple(job.pattern for job in jobs))
        if key not in self._plans:
            rank = dist.get_rank(domain.group)
            by_layout = {}  # parameters laid out alike share one holdings tuple, and so one analysis in the plan
            for job, layout in zip(jobs, layouts):
                if layout not in by_layout:
                    by_layout[layout] = group_holdings(job.param, domain.group)
                try:
                    check_local_shard(job.param, by_layout[layout][rank])
                except LayoutError as error:
                    raise ValueError(f"Per-Head Muon cannot split Newton–Schulz of {_describe(job)}: {error}.") \
                        from None
            tilings = [Tiling.of(job.param.shape, job.pattern) for job in jobs]
            self._plans[key] = ShardedPlan(tilings, [by_layout[layout] for layout in layouts], NS_STEPS)
        return self._plans[key]

    def newton_schulz_plans(self) -> list:
        """The block assignments of the steps so far (``kimi_k3.optim.split_newton_schulz`` plans), for planners and
        tests that compare them with a layout's."""
        return list(self._plans.values())

    def _momentum_buffer(self, param):
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        return state["momentum_buffer"]

    def _advance_momentum(self, job):
        return elementwise.run(elementwise.advance_momentum_, self._momentum_buffer(job.param), job.param.grad,
                               job.group["momentum"])

    def _momentum_and_update(self, job):
        """`_advance_momentum` then `_nesterov_update` in one pass over the parameter (the same bits)."""
        if not job.group["nesterov"]:
            return self._advance_momentum(job)
        return elementwise.run(elementwise.momentum_and_nesterov_update_, self._momentum_buffer(job.param),
                               job.param.grad, job.group["momentum"], self.ns_dtype)

    def _nesterov_update(self, p, group, buffer):
        """The update Newton–Schulz orthogonalises, already in its dtype (the rounding it would do on reading)."""
        if not group["nesterov"]:
            return buffer
        return elementwise.run(elementwise.nesterov_update, p.grad, buffer, group["momentum"], self.ns_dtype)

    @staticmethod
    def _apply(job, update, scale):
        lr, weight_decay = job.group["lr"], job.group["weight_decay"]
        elementwise.run(elementwise.decay_and_add_, job.param, update, 1 - lr * weight_decay, -lr * scale)

    def _adamw_step(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        fused = fused_adamw_applies(params)
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            if fused and state["step"].device != p.device:  # fused kernels read the count on the parameter's device
                state["step"] = state["step"].to(p.device)
        beta1, beta2 = group["betas"]
        # A fused call takes plain tensors or DTensors, not both; each parameter's update is its own either way.
        for kind in _plain_and_sharded(params):
            states = [self.state[p] for p in kind]
            adamw(kind, [p.grad for p in kind], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                  [], [s["step"] for s in states], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, fused=fused)


FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def fused_adamw_applies(params) -> bool:
    """Whether torch's fused AdamW (``fused=True``: one kernel per parameter for the ten or so its single-tensor loop
    runs, the loop torch picks for CPU tensors) takes ``params``: floating-point tensors on a CPU or CUDA device. The
    two round some elements differently, both within fp32's rounding scale of a float64 AdamW
    (``tests/optim/test_muon.py``); ``benchmarks/bench_optimizer.py`` times them. The choice depends on the parameters
    alone, never on their layout, so sharded steps (where a rank holds ``DTensor``s) stay bitwise the single-process
    step."""
    return bool(params) and all(p.is_floating_point() and p.device.type in FUSED_ADAMW_DEVICES for p in params)


def _plain_and_sharded(params):
    """``params`` split into plain tensors and ``DTensor``s (empty lists left out)."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [kind for kind in (plain, sharded) if kind]


def _param_names(group):
    unnamed = [f"parameter {i} of shape {tuple(p.shape)}" for i, p in enumerate(group["params"])]
    return group.get("param_names") or unnamed


def _describe(job) -> str:
    """The parameter's name with its layout, for one-line refusals."""
    layout = ""
    if isinstance(job.param, DTensor):
        mesh = job.param.device_mesh
        layout = f" (placements {tuple(job.param.placements)} on a mesh of shape {tuple(mesh.mesh.shape)}"
        layout += f" named {mesh.mesh_dim_names})" if mesh.mesh_dim_names else ")"
    return f"{job.name}{layout}"


def _local_matrix(tensor):
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.reshape(math.prod(local.shape[:-1]), local.shape[-1])


def _match_rms_scale(block):
    return _match_rms_scale_of_shape(*block.shape[-2:])


def _match_rms_scale_of_shape(rows, cols):
    return MATCH_RMS_ADAMW * math.sqrt(max(rows, cols))


def _check_replicated(updates, group):
    """Plain parameters under a process group are taken as replicated (DDP); on the first step every rank compares the
    sums of its updates with the others', since a rank training its own copy would silently get other ranks' blocks."""
    sums = torch.stack([update.to_local().sum() if isinstance(update, DTensor) else update.sum() for update in updates])
    bits = sums.float().view(torch.int32)  # compared as bit patterns: NaN sums match too
    highest, lowest = bits.clone(), bits.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(highest, lowest):
        raise ValueError(
            "Per-Head Muon found different updates on different ranks for parameters it took as replicated (plain "
            "tensors under torch.distributed, as DDP keeps them); pass split_newton_schulz=False when each rank "
            "trains its own model."
        )


def _check_group(group):
    """Reject parameters Muon cannot orthogonalize, with the offending shape and the allowed layouts."""
    if group["head_rows"] is not None and not group["params"]:
        raise ValueError("A param group with `head_rows` has no parameters; Per-Head Muon would silently be inert.")
    if not group["use_muon"]:
        return
    if group["head_rows"] is not None and group["expert_rows"] is not None:
        raise ValueError(
            "A Muon param group takes `head_rows` (2-D attention) or `expert_rows` (3-D experts), not both."
        )
    for p in group["params"]:
        expected_ndim = 2 if group["expert_rows"] is None else 3
        if p.ndim != expected_ndim:
            raise ValueError(
                f"Muon param groups hold 2-D matrices, or 3-D stacked experts [E, rows, cols] when `expert_rows` is "
                f"set; got a {p.ndim}-D parameter of shape {tuple(p.shape)} in a group with "
                f"expert_rows={group['expert_rows']}. Put it in a `use_muon=False` (AdamW) group."
            )
        pattern = row_pattern(group)
        if pattern is not None and p.shape[-2] % sum(pattern):
            raise ValueError(
                f"Block rows {pattern} (sum {sum(pattern)}) do not divide the {p.shape[-2]} rows of a parameter of "
                f"shape {tuple(p.shape)}; `head_rows`/`expert_rows` must tile the rows exactly."
            )


def build_param_groups(model, weight_decay=0.1, adamw_lr=None, split_kv=True, per_head=True):
    """Param groups of a Kimi K3 model (K3 report §2.5); head sizes come from ``model.config``.

    Each group lists its parameters' names under ``param_names`` (torch's named param groups). Muon: every trainable
    2-D weight (KDA q/k/v in ``linear_head_dim`` row blocks; MLA q_b_proj in
    nope+rope blocks; kv_b_proj in (nope, v) or nope+v blocks; a vision tower's wqkv in head_dim blocks, one per
    q, k and v head; the rest whole), and the stacked experts per expert
    (shared-basis experts: each basis matrix, split like an expert; their coefficients go to AdamW).
    AdamW: embeddings, lm_head, conv kernels and the [1, hidden] AttnRes pseudo-queries (with decay), and 1-D tensors
    (without decay). Buffers such as the router's ``e_score_correction_bias`` are in no group. ``per_head=False``
    leaves the attention projections whole (whole-matrix Muon); the experts stay one block per expert matrix.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "kimi_k3":
        raise ValueError(
            f"build_param_groups needs a Kimi K3 model (config.model_type == 'kimi_k3'), got "
            f"{type(model).__name__} with model_type={getattr(config, 'model_type', None)!r}."
        )
    head_rows = head_rows_by_layer_type(config, split_kv) if per_head else {}
    by_tag, tagged_layer_types = defaultdict(list), set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            tag, layer_type = _group_tag(name, p, config, head_rows)
            by_tag[tag].append((name, p))
            tagged_layer_types.add(layer_type)
    if per_head:
        _require_head_blocks(head_rows, set(config.layer_types) - tagged_layer_types)
    groups = [{"params": [p for _, p in named], "param_names": [name for name, _ in named], **dict(tag)}
              for tag, named in by_tag.items()]
    for group in groups:
        if not group["use_muon"] and adamw_lr is not None:
            group["lr"] = adamw_lr
        group.setdefault("weight_decay", weight_decay)
    return groups


def head_rows_by_layer_type(config, split_kv):
    mla_rows = config.qk_nope_head_dim + config.qk_rope_head_dim
    kv_rows = (config.qk_nope_head_dim, config.v_head_dim) if split_kv else config.qk_nope_head_dim + config.v_head_dim
    head_rows = {
        "linear_attention": dict.fromkeys(_KDA_HEAD_PROJS, config.linear_head_dim),
        "full_attention": {**dict.fromkeys(_MLA_QUERY_PROJS, mla_rows), "kv_b_proj": kv_rows},
    }
    if getattr(config, "vision_config", None) is not None:
        head_rows["vision"] = {"wqkv": config.vision_config.head_dim}
    return head_rows


def _group_tag(name, p, config, head_rows):
    """(hashable group keys, layer type whose head rows tag the parameter or None) of one named parameter."""
    if p.ndim < 2:
        return (("use_muon", False), ("weight_decay", 0.0)), None
    if "embed_tokens" in name or "lm_head" in name or name.endswith("_res_proj.weight"):
        return (("use_muon", False),), None
    if VISION_QKV_PARAM.search(name) and "vision" in head_rows:
        return (("use_muon", True), ("head_rows", head_rows["vision"]["wqkv"])), None
    layer = LAYER_PARAM.search(name)
    if layer is not None:
        layer_type = config.layer_types[int(layer.group(1))]
        rows = head_rows.get(layer_type, {}).get(layer.group(2))
        if rows is not None:
            return (("use_muon", True), ("head_rows", rows)), layer_type
    module, weight = name.rsplit(".", 2)[-2:]
    if module == "experts" and weight.endswith("_coefficients"):
        return (("use_muon", False),), None  # shared-basis mixing weights, not a map of activations
    weight = BASIS_OF_EXPERT_TENSOR.get(weight, weight)  # a basis matrix has the row blocks of the expert it builds
    if p.ndim == 3 and module == "experts" and weight in EXPERT_LAYOUT:
        return (("use_muon", True), ("expert_rows", expert_block_rows(weight, tuple(p.shape)))), None
    return (("use_muon", p.ndim == 2),), None


def _require_head_blocks(head_rows, untagged_layer_types):
    """A config whose KDA/MLA q/k/v were not found would leave Per-Head Muon inert."""
    missing = sorted(untagged_layer_types - {None})
    if missing:
        names = {layer_type: sorted(head_rows[layer_type]) for layer_type in missing}
        raise ValueError(
            f"The config has {missing} layers but none of their per-head projections "
            f"(layers.<i>.self_attn.<name>.weight, names {names}) is a trainable parameter of the model, so "
            f"Per-Head Muon would be inert."
        )


def _refuse_lora_adapters(model) -> None:
    """Per-Head Muon's blocks are heads and experts of full weight matrices. A LoRA factor (r x n or n x r) has no
    heads, and orthogonalizing it sets all r of its singular values to one scale every step, which throws away the
    adapter's own spectrum; AdamW is what LoRA recipes use."""
    lora = [name for name, p in model.named_parameters() if p.requires_grad and ".lora_" in name]
    if lora:
        raise ValueError(
            f"PerHeadMuon.for_model: the model trains LoRA adapters (e.g. {lora[0]}); Per-Head Muon orthogonalizes "
            "whole per-head weight matrices, not low-rank LoRA factors. Train the adapters with AdamW (Trainer's "
            "default optimizer, or --optimizer adamw), or merge them and train the full model with Per-Head Muon."
        )


class PerHeadMuonFactory:
    """Trainer factory: ``Trainer(optimizer_cls_and_kwargs=(PerHeadMuonFactory, kwargs))`` calls
    ``PerHeadMuonFactory()(model, **kwargs)``; kwargs are those of
    :meth:`PerHeadMuon.for_model`. Trainer passes a factory the model and these kwargs only, never the
    ``TrainingArguments``, so ``lr`` and ``weight_decay`` must be in kwargs: :meth:`from_training_args` copies them
    (and the AdamW betas and epsilon) from the arguments."""

    @classmethod
    def from_training_args(cls, args, **overrides) -> tuple[type, dict]:
        """``optimizer_cls_and_kwargs`` that trains with ``args``' learning rate, weight decay and AdamW settings."""
        kwargs = {
            "lr": args.learning_rate,
            "weight_decay": args.weight_decay,
            "adamw_betas": (args.adam_beta1, args.adam_beta2),
            "adamw_eps": args.adam_epsilon,
        }
        return cls, {**kwargs, **overrides}

    def __call__(self, model, **kwargs):
        missing = [name for name in ("lr", "weight_decay") if name not in kwargs]
        if missing:
            raise ValueError(
                f"PerHeadMuonFactory needs {' and '.join(missing)} in its kwargs: Trainer does not pass it the "
                "TrainingArguments, so their learning_rate and weight_decay would be ignored. Use "
                "`optimizer_cls_and_kwargs=PerHeadMuonFactory.from_training_args(args)` or pass "
                "`{'lr': args.learning_rate, 'weight_decay': args.weight_decay}`."
            )
        return PerHeadMuon.for_model(model, **kwargs)
