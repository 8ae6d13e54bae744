"""Newton–Schulz: the buffered loop against the textbook one, and batch invariance (a block's result depends on that
block alone, whatever shares its calls and however many threads run them)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kimi_k3.optim.newton_schulz as newton_schulz
from kimi_k3.optim.newton_schulz import (
    NewtonSchulzQueue,
    chunk_blocks,
    newton_schulz_flops,
    newton_schulz5_call,
    orthogonalize_by_shape,
    queue_flops,
    zeropower_via_newton_schulz5,
)

# Shapes on both sides of the sizes where CPU libraries switch kernels: (4, 256) and (8, 32) blocks are products below
# oneDNN's 16³ (so a batch of one and a larger batch took different bf16 kernels), (64, 128) is one MKL rounds
# differently alone; tall and wide, and one chunk of a single block (256, 1024).
SHAPES = [(4, 256), (8, 32), (32, 8), (24, 64), (64, 128), (128, 128), (256, 1024)]
DTYPES = [torch.float32, torch.bfloat16]


def fresh_tensor_newton_schulz5(x, steps, eps=1e-7):
    """NS5 as Keller Jordan's Muon writes it, every product a new tensor: the reference for the buffered loop."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_newton_schulz_into_reused_buffers_is_bitwise_the_fresh_tensor_loop(dtype):
    generator = torch.Generator().manual_seed(7)
    for _ in range(4):
        count, short, extra = (int(n) for n in torch.randint(1, 40, (3,), generator=generator))
        for shape in ((count, short, short + extra), (count, short, short)):
            blocks = torch.randn(shape, generator=generator).to(dtype)
            for steps in (1, 2, 5):
                assert torch.equal(newton_schulz5_call(blocks, steps=steps),
                                   fresh_tensor_newton_schulz5(blocks, steps)), (shape, steps)


def test_tall_blocks_are_the_transpose_of_their_wide_transpose():
    blocks = torch.randn(5, 48, 16)
    assert torch.equal(zeropower_via_newton_schulz5(blocks, dtype=torch.float32),
                       zeropower_via_newton_schulz5(blocks.mT.contiguous(), dtype=torch.float32).mT)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_blocks_result_does_not_depend_on_what_shares_its_calls_nor_on_the_thread_count(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    count = 2 * chunk_blocks(*sorted(shape)) + 3  # two full chunks and a padded one
    blocks = torch.randn(count, *shape, generator=generator)
    whole = zeropower_via_newton_schulz5(blocks, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        for num_threads in {1, threads}:
            torch.set_num_threads(num_threads)
            for start, stop in ((0, 1), (count - 1, count), (1, count // 2 + 1), (3, count)):
                alone = zeropower_via_newton_schulz5(blocks[start:stop], dtype=dtype)
                assert torch.equal(alone, whole[start:stop]), (num_threads, start, stop)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_streamed_groups_get_what_one_call_per_group_gives(dtype):
    """Groups of stacks of mixed shapes and orientations through one queue, each group's source freed (here:
    overwritten) right after it is submitted, against each stack orthogonalised on its own."""
    generator = torch.Generator().manual_seed(3)
    groups = [[torch.randn(n, *shape, generator=generator) for n, shape in stacks]
              for stacks in ([(5, (8, 32)), (1, (32, 8))], [], [(70, (8, 32))], [(2, (16, 24)), (0, (8, 32))],
                             [(3, (8, 32)), (4, (24, 16))])]
    expected = [[zeropower_via_newton_schulz5(stack, dtype=dtype) for stack in group] for group in groups]
    received = {}
    queue = NewtonSchulzQueue(dtype)
    for index, group in enumerate(groups):
        queue.submit(group, lambda outputs, index=index: received.setdefault(index, outputs))
        for stack in group:
            stack.fill_(float("nan"))
    # The 70 blocks of group 2 filled a chunk with group 0's, which was then complete; 6 of them wait for the flush.
    assert 0 in received and 2 not in received
    queue.flush()
    assert sorted(received) == list(range(len(groups)))
    for index, outputs in received.items():
        assert [output.shape for output in outputs] == [stack.shape for stack in groups[index]]
        assert all(output.dtype == dtype for output in outputs)
        for output, want in zip(outputs, expected[index]):
            assert torch.equal(output, want), index


def test_every_call_takes_exactly_the_chunk_of_its_shape(monkeypatch):
    calls = []

    def counting(x, *args):
        calls.append(tuple(x.shape))
        assert x.is_contiguous()
        return newton_schulz5_call(x, *args)

    monkeypatch.setattr(newton_schulz, "newton_schulz5_call", counting)
    stacks = [torch.randn(shape) for shape in ((3, 8, 24), (70, 8, 24), (2, 24, 8), (1, 512, 1024))]
    orthogonalize_by_shape(stacks, torch.float32)
    small, large = chunk_blocks(8, 24), chunk_blocks(512, 1024)
    assert large == 1 and small > 1
    assert sorted(calls) == sorted([(small, 8, 24)] * -(-75 // small) + [(large, 512, 1024)])


def test_zero_padding_blocks_stay_zero_and_finite():
    assert torch.equal(newton_schulz5_call(torch.zeros(3, 4, 8)), torch.zeros(3, 4, 8))


def test_newton_schulz_flops_count_the_three_products_of_every_step():
    # 16 x 64: X Xᵀ and (...) X are 2·16²·64 each, (X Xᵀ)² is 2·16³; the orientation does not matter.
    assert newton_schulz_flops(16, 64, 5) == newton_schulz_flops(64, 16, 5) == 5 * (4 * 16 * 16 * 64 + 2 * 16**3)


def test_queue_flops_are_what_torch_counts_in_its_calls():
    shapes = [(8, 24)] * 75 + [(24, 8)] * 2 + [(512, 1024)]
    stacks = [torch.randn(1, *shape) for shape in shapes]
    with FlopCounterMode(display=False) as counter:
        orthogonalize_by_shape(stacks, torch.float32)
    assert counter.get_total_flops() == queue_flops(shapes)
    padded = -(-77 // chunk_blocks(8, 24)) * chunk_blocks(8, 24)
    assert queue_flops(shapes) == padded * newton_schulz_flops(8, 24) + newton_schulz_flops(512, 1024)
