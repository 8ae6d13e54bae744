"""Kimi Delta Attention kernels: chunked form ≡ recurrent form ≡ a naive loop written from the Kimi Linear paper's recurrence (arXiv:2510.26692)."""

from functools import partial

import pytest
import torch

from kda_kimi_k3 import (
    chunk_kda,
    kda_decay_gate,
    kda_intra_chunk_scores,
    kda_sub_chunk_size,
    l2_normalize,
    recurrent_kda,
)
from tests.conftest import TEST_DEVICE, seeded_generator
from tests.numerics import assert_as_accurate

pytestmark = pytest.mark.device  # runs on KIMI_K3_TEST_DEVICE (tests/conftest.py)


def naive_kda(q, k, v, g, beta, initial_state=None):
    """The delta-rule recurrence, one head and one token at a time with explicit matrices."""
    batch, seq_len, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    out = torch.zeros(batch, seq_len, heads, v_dim, dtype=q.dtype)
    final = torch.zeros(batch, heads, k_dim, v_dim, dtype=q.dtype)
    for b in range(batch):
        for h in range(heads):
            state = torch.zeros(k_dim, v_dim, dtype=q.dtype) if initial_state is None else initial_state[b, h].clone()
            for t in range(seq_len):
                decayed = torch.diag(g[b, t, h].exp()) @ state
                u = v[b, t, h] - decayed.T @ k[b, t, h]
                state = decayed + beta[b, t, h] * torch.outer(k[b, t, h], u)
                out[b, t, h] = state.T @ q[b, t, h]
            final[b, h] = state
    return out, final


def random_inputs(batch, seq_len, heads, k_dim, v_dim, lower_bound=-5.0, dtype=torch.float64, seed=0):
    gen = seeded_generator(seed)
    q = l2_normalize(torch.randn(batch, seq_len, heads, k_dim, generator=gen, dtype=dtype)) * k_dim**-0.5
    k = l2_normalize(torch.randn(batch, seq_len, heads, k_dim, generator=gen, dtype=dtype))
    v = torch.randn(batch, seq_len, heads, v_dim, generator=gen, dtype=dtype)
    f = torch.randn(batch, seq_len, heads * k_dim, generator=gen, dtype=dtype)
    A_log = torch.rand(heads, generator=gen, dtype=dtype)
    dt_bias = torch.randn(heads * k_dim, generator=gen, dtype=dtype)
    g = kda_decay_gate(f, A_log, dt_bias, lower_bound).to(dtype)
    beta = torch.rand(batch, seq_len, heads, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("seq_len", [1, 7, 16, 37, 64])
def test_recurrent_kda_matches_naive_loop_fp64(seq_len):
    q, k, v, g, beta = random_inputs(2, seq_len, 2, 6, 5)
    out, state = recurrent_kda(q, k, v, g, beta)
    ref_out, ref_state = naive_kda(q, k, v, g, beta)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "batch,seq_len,heads,k_dim,v_dim,chunk", [(2, 37, 2, 8, 4, 16), (1, 100, 3, 4, 6, 16), (2, 130, 2, 8, 8, 64), (1, 5, 1, 4, 4, 64)]
)
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunked_kda_matches_recurrence_fp64(batch, seq_len, heads, k_dim, v_dim, chunk, with_initial_state):
    q, k, v, g, beta = random_inputs(batch, seq_len, heads, k_dim, v_dim, seed=seq_len)
    initial = torch.randn(batch, heads, k_dim, v_dim, dtype=torch.float64) if with_initial_state else None
    out, state = chunk_kda(q, k, v, g, beta, initial_state=initial, chunk_size=chunk)
    ref_out, ref_state = recurrent_kda(q, k, v, g, beta, initial_state=initial)
    assert (out - ref_out).abs().max() <= 1e-10
    assert (state - ref_state).abs().max() <= 1e-10


def test_chunked_kda_matches_naive_loop_fp64():
    q, k, v, g, beta = random_inputs(1, 45, 2, 4, 3, seed=3)
    out, state = chunk_kda(q, k, v, g, beta, chunk_size=16)
    ref_out, ref_state = naive_kda(q, k, v, g, beta)
    assert (out - ref_out).abs().max() <= 1e-10
    assert (state - ref_state).abs().max() <= 1e-10


def test_chunked_kda_survives_strongest_decay_in_fp32():
    """With g ≈ lb = −5 at every step, γ reaches −320 inside a 64-chunk; e^{γ_r−γ_s} must stay finite."""
    q, k, v, _, beta = random_inputs(1, 128, 2, 8, 8, dtype=torch.float32)
    g = torch.full_like(q, -4.99)
    out, state = chunk_kda(q, k, v, g, beta)
    ref_out, ref_state = recurrent_kda(q, k, v, g, beta)
    exact_out, exact_state = recurrent_kda(*(x.double() for x in (q, k, v, g, beta)))
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    assert_as_accurate(out, ref_out, exact_out, what="output")
    assert_as_accurate(state, ref_state, exact_state, what="state")


def test_split_prefill_carries_state_exactly_fp64():
    q, k, v, g, beta = random_inputs(2, 90, 2, 4, 4, seed=5)
    full, full_state = chunk_kda(q, k, v, g, beta, chunk_size=16)
    first, state = chunk_kda(q[:, :51], k[:, :51], v[:, :51], g[:, :51], beta[:, :51], chunk_size=16)
    second, second_state = chunk_kda(
        q[:, 51:], k[:, 51:], v[:, 51:], g[:, 51:], beta[:, 51:], initial_state=state, chunk_size=16
    )
    assert (torch.cat([first, second], 1) - full).abs().max() <= 1e-10
    assert (second_state - full_state).abs().max() <= 1e-10


def test_chunked_kda_gradients_match_recurrence():
    inputs = [x.requires_grad_() for x in random_inputs(1, 40, 2, 4, 4, seed=7)]
    out, state = chunk_kda(*inputs, chunk_size=16)
    grads = torch.autograd.grad((out.sin().sum() + state.cos().sum()), inputs)
    ref_out, ref_state = recurrent_kda(*inputs)
    ref_grads = torch.autograd.grad((ref_out.sin().sum() + ref_state.cos().sum()), inputs)
    for grad, ref in zip(grads, ref_grads):
        assert (grad - ref).abs().max() <= 1e-9


def test_decay_gate_is_lower_bounded_sigmoid_form():
    f = torch.randn(3, 5, 2 * 4, dtype=torch.float64) * 10
    A_log = torch.tensor([0.0, 1.0], dtype=torch.float64)
    dt_bias = torch.randn(8, dtype=torch.float64)
    g = kda_decay_gate(f, A_log, dt_bias, -5.0)
    expected = -5.0 * torch.sigmoid(A_log.exp()[:, None] * (f.view(3, 5, 2, 4) + dt_bias.view(2, 4)))
    torch.testing.assert_close(g, expected, rtol=0, atol=0)
    assert (g <= 0).all() and (g >= -5).all()


def test_sub_chunk_size_keeps_the_bridge_exponent_finite():
    assert kda_sub_chunk_size(64, None, torch.float32) == 1
    assert kda_sub_chunk_size(64, -5.0, torch.float32) == 16  # 15·5 = 75 <= ln(3.4e38) − 8
    assert kda_sub_chunk_size(64, -5.0, torch.bfloat16) == 16
    assert kda_sub_chunk_size(64, -5.0, torch.float64) == 64
    assert kda_sub_chunk_size(64, -5.0, torch.float16) == 1
    assert kda_sub_chunk_size(48, -5.0, torch.float32) == 16
    assert kda_sub_chunk_size(64, -100.0, torch.float64) == 8


@pytest.mark.parametrize("sub_chunk_size", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("decay", ["random", "strongest"])
def test_intra_chunk_scores_equal_the_exponent_of_a_difference_fp64(sub_chunk_size, decay):
    """Sub-chunk matmuls ≡ Σ_c x_r k_s e^{γ_r−γ_s} with the masked [C, C, D] decay."""
    q, k, _, g, _ = random_inputs(2, 32, 3, 8, 1, seed=sub_chunk_size)
    if decay == "strongest":
        g = torch.full_like(g, -4.99)  # γ reaches −160 in the chunk: e^{+160} would overflow fp32
    q, k, gamma = (x.transpose(1, 2) for x in (q, k, g.cumsum(1)))
    query_key, key_key = kda_intra_chunk_scores(q, k, gamma, sub_chunk_size)
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    full_decay = (gamma[..., :, None, :] - gamma[..., None, :, :]).masked_fill(~causal[..., None], -torch.inf).exp()
    expected_qk = torch.einsum("bhrc,bhsc,bhrsc->bhrs", q, k, full_decay)
    expected_kk = torch.einsum("bhrc,bhsc,bhrsc->bhrs", k, k, full_decay).tril(-1)
    assert (query_key - expected_qk).abs().max() <= 1e-12
    assert (key_key - expected_kk).abs().max() <= 1e-12


@pytest.mark.parametrize("lower_bound", [-5.0, -100.0])
@pytest.mark.parametrize("batch,seq_len,heads,k_dim,v_dim,chunk", [(2, 37, 2, 8, 4, 16), (1, 130, 3, 4, 6, 64)])
def test_sub_chunked_kda_matches_recurrence_fp64(lower_bound, batch, seq_len, heads, k_dim, v_dim, chunk):
    """fp64 with lb = −5 factors over the whole chunk (S = C); lb = −100 forces S = 8."""
    q, k, v, g, beta = random_inputs(batch, seq_len, heads, k_dim, v_dim, lower_bound=lower_bound, seed=seq_len)
    initial = torch.randn(batch, heads, k_dim, v_dim, dtype=torch.float64)
    out, state = chunk_kda(q, k, v, g, beta, initial_state=initial, chunk_size=chunk, gate_lower_bound=lower_bound)
    ref_out, ref_state = recurrent_kda(q, k, v, g, beta, initial_state=initial)
    assert (out - ref_out).abs().max() <= 1e-10
    assert (state - ref_state).abs().max() <= 1e-10


def test_sub_chunked_kda_survives_strongest_decay_in_fp32():
    """fp32 with lb = −5 uses 16-step sub-chunks: factors up to e^{75}, finite, and the result matches the loop."""
    q, k, v, _, beta = random_inputs(1, 128, 2, 8, 8, dtype=torch.float32)
    g = torch.full_like(q, -4.99)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    out, state = chunk_kda(*inputs, gate_lower_bound=-5.0)
    ref_out, ref_state = recurrent_kda(q, k, v, g, beta)
    exact_out, exact_state = recurrent_kda(*(x.detach().double() for x in (q, k, v, g, beta)))
    # Products with factors up to e^{±75} round before they cancel: this form's fp32 error is up to ~20x the
    # recurrence's (9e-7 against 5e-8 here, 1.8e-6 of the output's scale), a property of the algorithm, not the CPU.
    assert_as_accurate(out, ref_out, exact_out, what="output", factor=64)
    assert_as_accurate(state, ref_state, exact_state, what="state", factor=64)
    grads = torch.autograd.grad(out.square().sum() + state.square().sum(), inputs)
    assert all(torch.isfinite(grad).all() for grad in grads)


@pytest.mark.parametrize("lower_bound", [None, -5.0, -100.0])
def test_sub_chunked_kda_gradients_match_recurrence_fp64(lower_bound):
    inputs = random_inputs(2, 45, 2, 4, 3, lower_bound=lower_bound or -5.0, seed=11)
    initial = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    inputs = [x.requires_grad_() for x in (*inputs, initial)]
    *kernel_inputs, state_in = inputs
    out, state = chunk_kda(*kernel_inputs, initial_state=state_in, chunk_size=16, gate_lower_bound=lower_bound)
    grads = torch.autograd.grad(out.sin().sum() + state.cos().sum(), inputs)
    ref_out, ref_state = recurrent_kda(*kernel_inputs, initial_state=state_in)
    ref_grads = torch.autograd.grad(ref_out.sin().sum() + ref_state.cos().sum(), inputs)
    for grad, ref in zip(grads, ref_grads):
        assert (grad - ref).abs().max() <= 1e-9


def test_kda_kernels_ignore_bf16_autocast():
    """The state recurrence stays fp32 under autocast: results are bit-identical."""
    q, k, v, g, beta = random_inputs(1, 70, 2, 8, 8, dtype=torch.float32, seed=4)
    chunked, chunked_state = chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0)
    recurrent, recurrent_state = recurrent_kda(q, k, v, g, beta)
    with torch.autocast(TEST_DEVICE.type, dtype=torch.bfloat16):
        assert torch.equal(chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0)[0], chunked)
        assert torch.equal(chunk_kda(q, k, v, g, beta, gate_lower_bound=-5.0)[1], chunked_state)
        assert torch.equal(recurrent_kda(q, k, v, g, beta)[0], recurrent)
        assert torch.equal(recurrent_kda(q, k, v, g, beta)[1], recurrent_state)


# ------------------------------------------------------------------------------------------------ packed documents
def packed_lengths(chunk: int, seed: int, longest_random: int | None = None) -> list[int]:
    """Random document lengths that include a single token, a document ending exactly on a chunk boundary and one
    filling a whole chunk, then three of up to ``longest_random`` (default two chunks) tokens."""
    gen = seeded_generator(seed)
    first = int(torch.randint(2, chunk, (), generator=gen))
    lengths = [first, 1, chunk - (first + 1) % chunk, chunk]
    return lengths + torch.randint(1, (longest_random or 2 * chunk) + 1, (3,), generator=gen).tolist()


def starts_of(lengths: list[int]) -> torch.Tensor:
    """[1, T] document starts of documents of these lengths packed into one row."""
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    starts[torch.tensor(lengths[:-1]).cumsum(0)] = True
    return starts[None]


def one_by_one(kernel, inputs, lengths):
    """Each document through ``kernel`` alone from a zero state: outputs joined, and the last document's state."""
    outputs, state = [], None
    for document in zip(*(x.split(lengths, dim=1) for x in inputs)):
        output, state = kernel(*document)
        outputs.append(output)
    return torch.cat(outputs, dim=1), state


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("chunk", [16, 64])
def test_packed_chunked_kda_equals_the_documents_run_one_by_one_fp64(chunk, lower_bound):
    lengths = packed_lengths(chunk, seed=chunk)
    inputs = random_inputs(1, sum(lengths), 2, 8, 4, seed=chunk)
    kernel = partial(chunk_kda, chunk_size=chunk, gate_lower_bound=lower_bound)
    out, state = kernel(*inputs, document_starts=starts_of(lengths))
    ref_out, ref_state = one_by_one(kernel, inputs, lengths)
    assert (out - ref_out).abs().max() <= 1e-10
    assert (state - ref_state).abs().max() <= 1e-10


def test_packed_recurrent_kda_equals_the_documents_run_one_by_one_fp64():
    lengths = packed_lengths(16, seed=1)
    inputs = random_inputs(1, sum(lengths), 2, 6, 5, seed=1)
    out, state = recurrent_kda(*inputs, document_starts=starts_of(lengths))
    ref_out, ref_state = one_by_one(naive_kda, inputs, lengths)
    assert (out - ref_out).abs().max() <= 1e-12
    assert (state - ref_state).abs().max() <= 1e-12


def test_packed_kernels_agree_on_rows_of_their_own_boundaries_and_a_start_drops_the_initial_state_fp64():
    """Two rows packed differently, starts anywhere (the first token included) and an incoming state."""
    q, k, v, g, beta = random_inputs(2, 83, 2, 4, 3, seed=9)
    starts = torch.rand(2, 83, generator=seeded_generator(9)) < 0.1
    starts[1, 0] = True
    initial = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    out, state = chunk_kda(q, k, v, g, beta, initial, chunk_size=16, gate_lower_bound=-5.0, document_starts=starts)
    ref_out, ref_state = recurrent_kda(q, k, v, g, beta, initial, document_starts=starts)
    assert (out - ref_out).abs().max() <= 1e-10
    assert (state - ref_state).abs().max() <= 1e-10
    unstarted, _ = chunk_kda(q[1:], k[1:], v[1:], g[1:], beta[1:], chunk_size=16, document_starts=starts[1:])
    assert (out[1:] - unstarted).abs().max() <= 1e-10


def test_packed_chunked_kda_gradients_equal_the_documents_run_one_by_one_fp64():
    lengths = packed_lengths(16, seed=2)
    inputs = [x.requires_grad_() for x in random_inputs(1, sum(lengths), 2, 4, 4, seed=2)]
    kernel = partial(chunk_kda, chunk_size=16, gate_lower_bound=-5.0)
    out, state = kernel(*inputs, document_starts=starts_of(lengths))
    grads = torch.autograd.grad(out.sin().sum() + state.cos().sum(), inputs)
    ref_out, ref_state = one_by_one(kernel, inputs, lengths)
    ref_grads = torch.autograd.grad(ref_out.sin().sum() + ref_state.cos().sum(), inputs)
    for grad, ref in zip(grads, ref_grads):
        assert (grad - ref).abs().max() <= 1e-9


def test_packed_chunked_kda_survives_strongest_decay_across_boundaries_in_fp32():
    """γ keeps summing across a document start inside a chunk: the masked terms stay finite, the gradients too, and
    the packed kernel is as close to the float64 recurrence as the documents run one by one through it are."""
    lengths = packed_lengths(64, seed=3)
    q, k, v, _, beta = random_inputs(1, sum(lengths), 2, 8, 8, seed=3)
    exact_inputs = (q, k, v, torch.full_like(q, -4.99), beta)
    inputs = [x.float().requires_grad_() for x in exact_inputs]
    kernel = partial(chunk_kda, gate_lower_bound=-5.0)
    out, state = kernel(*inputs, document_starts=starts_of(lengths))
    trusted = one_by_one(kernel, inputs, lengths)
    exact = one_by_one(recurrent_kda, exact_inputs, lengths)
    for actual, fp32, fp64, what in zip((out, state), trusted, exact, ("output", "state")):
        assert_as_accurate(actual.detach(), fp32.detach(), fp64, what=what)
    grads = torch.autograd.grad(out.square().sum() + state.square().sum(), inputs)
    assert all(torch.isfinite(grad).all() for grad in grads)
