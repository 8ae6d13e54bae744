"""Newton–Schulz orthogonalisation of stacks of blocks, batch-invariant: a block's result depends on that block alone.

Muon's quintic Newton–Schulz iteration (Keller Jordan's Muon; Moonlight, arXiv:2502.16982) runs on many small
matrices (per-head and per-expert blocks, K3 report §2.5), batched by shape. CPU matmul libraries choose their kernel,
and with it the rounding, from the shape of the whole call: torch hands a bf16 batched product to oneDNN only when
batch·m·k·n exceeds 16³ and uses its own GEMM below that, and MKL's batched fp32 GEMM can round a batch of one
differently from a larger batch. A block's result would then depend on how many blocks shared its call, and Newton–Schulz
split across ranks (each rank batches its own share) would not reproduce the single process. So every call here takes
exactly :func:`chunk_blocks` blocks of one shape, a number fixed by the shape, in a contiguous buffer; the last chunk
of a shape is padded with zero blocks (zero in, zero out). The same idea as batch-invariant kernels for reproducible
inference (He et al., "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab, 2025).

Chunks of about 2¹⁸ elements also keep a call's working set in cache, so the default model's blocks orthogonalise
faster in chunks than in one call per shape, in bf16 and fp32 alike, under libgomp's default waiting (under
``OMP_WAIT_POLICY=PASSIVE`` each of the step's few thousand calls wakes a sleeping thread, and chunks are slower).
``benchmarks/bench_optimizer.py`` measures it; the figures are in benchmarks/records/.
"""

from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Callable

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
CHUNK_ELEMENTS = 1 << 18
MAX_CHUNK_BLOCKS = 64


def chunk_blocks(short: int, long: int) -> int:
    """Blocks per Newton–Schulz call for blocks of ``short`` x ``long`` (either orientation): a function of the shape."""
    return max(1, min(MAX_CHUNK_BLOCKS, CHUNK_ELEMENTS // (short * long)))


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of ``steps`` Newton–Schulz iterations on one block; with m, n its short and long sides each
    step multiplies X·Xᵀ (2m²n), (X·Xᵀ)² (2m³) and (...)·X (2m²n)."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m**3)


def queue_flops(block_shapes, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of the calls one :class:`NewtonSchulzQueue` makes for blocks of ``block_shapes`` ((rows, cols) of
    each block): every shape's blocks in whole chunks, the zero blocks padding the last one included."""
    counts = Counter(tuple(sorted(shape)) for shape in block_shapes)
    return sum(-(-count // chunk_blocks(*shape)) * chunk_blocks(*shape) * newton_schulz_flops(*shape, steps)
               for shape, count in counts.items())


def newton_schulz5_call(x, coefficients=NS_COEFFICIENTS, steps=NS_STEPS, eps=NS_EPS):
    """The iteration on one batch ``x`` [n, short, long] (wide blocks) in its own dtype: the polar factor U·S'·Vᵀ
    (S' ≈ 1) of every matrix. Each matrix is Frobenius-normalized on its own, which is what decouples the heads."""
    a, b, c = coefficients
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    # Every product writes into buffers allocated once: on a CPU each fresh tensor is new pages to fault in
    # (benchmarks/records/2026-12-01_step_profile_xeon-avx512.md). Same kernels, same bits.
    gram = x.new_empty(x.shape[0], x.shape[-2], x.shape[-2])
    polynomial = torch.empty_like(gram)
    iterates = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(min(steps, 2))]
    for step in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=polynomial)
        x = torch.baddbmm(x, polynomial, x, beta=a, out=iterates[step % 2])
    return x


class _Submission:
    """One submitted group of stacks: its outputs fill in chunk by chunk; ``done`` gets them when the last arrives."""

    def __init__(self, stacks, dtype, done):
        self.outputs = [torch.empty(stack.shape, dtype=dtype, device=stack.device) for stack in stacks]
        self.missing = sum(stack.shape[0] for stack in stacks)
        self.done = done

    def fill(self, index, start, values):
        output = self.outputs[index]
        (output.mT if output.size(-2) > output.size(-1) else output)[start:start + values.shape[0]] = values
        self.missing -= values.shape[0]
        if not self.missing:
            self.done(self.outputs)


@dataclass
class _Waiting:
    """Blocks of a submitted stack that have not run yet: its rows ``start:``, wide (short side first)."""

    submission: _Submission
    index: int
    start: int
    blocks: torch.Tensor


class NewtonSchulzQueue:
    """Orthogonalises stacks [n, rows, cols] submitted one group at a time, batching blocks of one shape across
    groups into calls of exactly :func:`chunk_blocks` blocks. Full chunks run as soon as they fill (a group's blocks
    that do not fill one wait, copied, for later groups); :meth:`flush` pads and runs the rest. A group's ``done``
    callback receives its outputs, each in the stack's shape and the queue's ``dtype``, once its last block has run.

    Streaming lets a caller that forms one parameter's update at a time (Per-Head Muon's step) batch across parameters
    without holding every update at once, and pad each shape's last chunk once per step instead of once per parameter.
    """

    def __init__(self, dtype, coefficients=NS_COEFFICIENTS, steps=NS_STEPS, eps=NS_EPS):
        self.dtype, self.coefficients, self.steps, self.eps = dtype, coefficients, steps, eps
        self._waiting: dict[tuple[int, int], deque[_Waiting]] = defaultdict(deque)  # by (short, long) side

    def submit(self, stacks: list[torch.Tensor], done: Callable[[list[torch.Tensor]], None]) -> None:
        submission = _Submission(stacks, self.dtype, done)
        if not submission.missing:
            done(submission.outputs)
        for index, stack in enumerate(stacks):
            wide = stack.mT if stack.size(-2) > stack.size(-1) else stack
            if not wide.shape[0]:
                continue
            shape = tuple(wide.shape[1:])
            waiting = self._waiting[shape]
            waiting.append(_Waiting(submission, index, 0, wide))
            while _count(waiting) >= chunk_blocks(*shape):
                self._run_chunk(shape, chunk_blocks(*shape))
            if waiting and waiting[-1].submission is submission:
                # The blocks left over wait for later groups as a copy: the caller may free the tensor they came from.
                waiting[-1].blocks = waiting[-1].blocks.to(self.dtype, copy=True)

    def flush(self) -> None:
        """Run every waiting block, each shape's last chunk padded with zero blocks."""
        for shape, waiting in self._waiting.items():
            if waiting:
                self._run_chunk(shape, _count(waiting))
        self._waiting.clear()

    def _run_chunk(self, shape, count):
        """One call on the first ``count`` waiting blocks of ``shape``, padded to the shape's chunk with zeros."""
        waiting = self._waiting[shape]
        chunk = torch.empty(chunk_blocks(*shape), *shape, dtype=self.dtype, device=waiting[0].blocks.device)
        taken, pieces = 0, []
        while taken < count:
            entry = waiting[0]
            used = min(entry.blocks.shape[0], count - taken)
            chunk[taken:taken + used] = entry.blocks[:used]
            pieces.append((entry.submission, entry.index, entry.start, taken, used))
            if used == entry.blocks.shape[0]:
                waiting.popleft()
            else:
                entry.start, entry.blocks = entry.start + used, entry.blocks[used:]
            taken += used
        chunk[taken:].zero_()
        result = newton_schulz5_call(chunk, self.coefficients, self.steps, self.eps)
        for submission, index, start, offset, used in pieces:
            submission.fill(index, start, result[offset:offset + used])


def _count(waiting: deque[_Waiting]) -> int:
    return sum(entry.blocks.shape[0] for entry in waiting)


def zeropower_via_newton_schulz5(blocks, coefficients=NS_COEFFICIENTS, steps=NS_STEPS, eps=NS_EPS,
                                 dtype=torch.bfloat16):
    """Approximate polar factor of every matrix in ``blocks`` [n, rows, cols], computed in ``dtype``, batch-invariant.

    NS5 only needs S' near 1, so bf16 suffices where it is fast; fp32 gives the same update to bf16 tolerance.
    """
    return orthogonalize_by_shape([blocks], dtype, coefficients, steps, eps)[0]


def orthogonalize_by_shape(stacks, dtype=torch.bfloat16, coefficients=NS_COEFFICIENTS, steps=NS_STEPS, eps=NS_EPS):
    """Newton–Schulz in ``dtype`` of every stack [n, rows, cols] of ``stacks``, blocks of one shape batched together
    (either orientation); the outputs in input order."""
    outputs = []
    queue = NewtonSchulzQueue(dtype, coefficients, steps, eps)
    queue.submit(stacks, outputs.extend)
    queue.flush()
    return outputs
