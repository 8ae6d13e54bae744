"""Kimi Delta Attention kernels: chunked form ≡ recurrent form ≡ a naive loop written from architecture.md §2.3."""

import pytest
import torch

from modeling_kimi_k3 import chunk_kda, kda_decay_gate, l2_normalize, recurrent_kda


def naive_kda(q, k, v, g, beta, initial_state=None):
    """architecture.md §2.3 step 6, one head and one token at a time with explicit matrices."""
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
    gen = torch.Generator().manual_seed(seed)
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
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


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
