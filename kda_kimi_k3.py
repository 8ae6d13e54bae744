"""Kimi Delta Attention kernels in torch (Kimi Linear §3, K3 report §2.1): the token-by-token recurrence, used for
decoding and as the reference, and the chunked WY form for training and prefill, equal to it up to rounding.

Inputs are fp32: q and k already L2-normalised, q scaled. Shapes: q, k [B, T, H, Dk]; v [B, T, H, Dv];
g [B, T, H, Dk] (log-decay, <= 0); beta [B, T, H]; state [B, H, Dk, Dv]; document_starts [B, T] (bool, True where a
packed document begins: the state restarts from zero before that token, as if its decay were e^{-inf} = 0).

After the kernels, the torch bodies of the model file's kernel seams, in fla's and causal-conv1d's call conventions: what
runs wherever flash-linear-attention's kernels (``fla/ops/kda``) do not. The file imports only torch and transformers'
activations, so it ships beside the model file in every saved folder.
"""

import math

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: the precision-critical paths run in fp32 for bf16 models and stay exact for fp64 references."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps): the eps sits inside the square root, as in FLA's l2norm."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_decay_gate(
    gate_input: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float
) -> torch.Tensor:
    """K3's "safe" decay gate g = lb·σ(exp(A_log[h])·(f + dt_bias)) ∈ (lb, 0), in fp32 (K3 report §2.1).

    It replaces Kimi Linear's −exp(A)·softplus(f + dt_bias); it is not a clamp of it.
    """
    num_heads = A_log.shape[0]
    dtype = torch.promote_types(gate_input.dtype, torch.float32)
    gate_input = gate_input.to(dtype).unflatten(-1, (num_heads, -1))
    dt_bias = dt_bias.to(dtype).view(num_heads, -1)
    return lower_bound * torch.sigmoid(A_log.to(dtype).exp()[:, None] * (gate_input + dt_bias))


def recurrent_kda(q, k, v, g, beta, initial_state=None, document_starts=None):
    """Token-by-token delta rule with per-channel decay (Kimi Linear Eq. 1); used for decoding.

    Like `chunk_kda` it ignores autocast: the state recurrence runs in the caller's precision (fp32 in the layer).
    """
    batch_size, seq_len, num_heads, k_dim = k.shape
    state = (
        q.new_zeros(batch_size, num_heads, k_dim, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    )
    if document_starts is not None:
        g = g.masked_fill(document_starts[:, :, None, None], float("-inf"))
    outputs = []
    with torch.autocast(q.device.type, enabled=False):
        for t in range(seq_len):
            state = state * g[:, t].exp()[..., None]
            k_t = k[:, t]
            correction = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_t)
            state = state + (beta[:, t, :, None] * k_t)[..., None] * correction[..., None, :]
            outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


# Sub-chunk factors reach e^{(S−1)|lb|}; staying this many nats below the dtype's overflow leaves room for the
# head_dim-term sums of the masked-out entries (fp32: e^{80} ≈ 5.5e34 against a maximum of ≈ 3.4e38).
_SUB_CHUNK_OVERFLOW_MARGIN = 8.0


def kda_sub_chunk_size(chunk_size: int, gate_lower_bound: float | None, dtype: torch.dtype) -> int:
    """Largest divisor S of the chunk whose in-sub-chunk decay range e^{(S−1)|lb|} is finite in ``dtype``.

    Unknown bound: S = 1, and every decay is the exponent of a difference (the form that is safe for any g ≤ 0).
    """
    if gate_lower_bound is None:
        return 1
    budget = math.log(torch.finfo(dtype).max) - _SUB_CHUNK_OVERFLOW_MARGIN
    fits = (size for size in range(chunk_size, 0, -1) if chunk_size % size == 0)
    return next(size for size in fits if (size - 1) * abs(gate_lower_bound) <= budget)


def kda_intra_chunk_scores(q, k, gamma, sub_chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed scores of every chunk against itself, as matmuls: [..., C, D] inputs -> [..., C, C] outputs.

    A_qk[r, s] = Σ_c q_rc k_sc e^{γ_rc−γ_sc} for s ≤ r, and A_kk the same with k_r for s < r. With a_i the first and
    z_j the last γ of the sub-chunks i ∋ r and j ∋ s, e^{γ_r−γ_s} = e^{γ_r−a_i} · e^{a_i−z_j} · e^{z_j−γ_s}: the
    outer exponents are ≤ 0, the bridge a_i − z_j is ≤ 0 for j < i and at most (S−1)|lb| for j = i. Never
    e^{γ_r}·e^{−γ_s} over a whole chunk: γ reaches −320 with lb = −5.
    """
    chunk_size = k.shape[-2]
    num_sub = chunk_size // sub_chunk_size
    q, k, gamma = (x.unflatten(-2, (num_sub, sub_chunk_size)) for x in (q, k, gamma))
    first, last = gamma[..., :1, :], gamma[..., -1:, :]
    from_first = (gamma - first).exp()
    keys_to_last = k * (last - gamma).exp()
    later = torch.ones(num_sub, num_sub, dtype=torch.bool, device=k.device).triu(1)[..., None, None]
    bridge = (first.unsqueeze(-3) - last.unsqueeze(-4)).masked_fill(later, float("-inf")).exp()  # [..., i, j, 1, D]
    keys = (bridge * keys_to_last.unsqueeze(-4)).flatten(-3, -2).transpose(-1, -2)  # [..., i, D, C]
    query_key = ((q * from_first) @ keys).flatten(-3, -2)
    key_key = ((k * from_first) @ keys).flatten(-3, -2)
    return query_key.tril(), key_key.tril(-1)


def _split_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...], zero-padding the tail to a whole chunk; contiguous in that order, so the
    chunk products below read their operands in place instead of copying each one first."""
    pad = (-x.shape[1]) % chunk_size
    x = x.transpose(1, 2)
    if pad:
        x = F.pad(x, (0, 0) * (x.ndim - 3) + (0, pad))
    return x.contiguous().unflatten(2, (-1, chunk_size))


def chunk_kda(
    q, k, v, g, beta, initial_state=None, chunk_size: int = 32, gate_lower_bound: float | None = None,
    document_starts=None,
):
    """Chunked KDA: the WY form of Kimi Linear §3.1 (``fla/ops/kda``), equal to `recurrent_kda` up to rounding.

    Everything that does not depend on the incoming state (decayed scores, T = (I + L)^-1, U, W) is computed for all
    chunks at once; only Ṽ = U − W S and the state update run chunk by chunk. Chunks of 32 tokens rather than FLA's
    64: the per-chunk work (scores, the triangular solve) shrinks with the chunk, and on a CPU that outweighs the longer
    chunk loop; with strong decays fewer decay products also fall into fp32's subnormal range, which is slow on x86.
    ``gate_lower_bound`` (every g ≥ lb) sizes the sub-chunks of `kda_intra_chunk_scores`; without it the kernel
    assumes nothing about g.
    Padding the tail with k = v = g = β = 0 leaves the state untouched, so any length works. Autocast is ignored:
    bf16 matmuls would break the fp32 state recurrence.

    ``document_starts`` resets the state inside the chunk structure: a reset zeroes every decay product that spans
    it, so each decayed term is masked by "no document starts between its two tokens" (`_decay_masks`) and the
    chunks still run as one batch of matmuls, whatever the number of documents.
    """
    with torch.autocast(q.device.type, enabled=False):
        return _chunk_kda(q, k, v, g, beta, initial_state, chunk_size, gate_lower_bound, document_starts)


def unit_lower_triangular_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for the strictly lower part L of ``lower`` (its diagonal is never read): torch's triangular solve,
    or, while ``torch.onnx.export`` traces the model, the same forward substitution written row by row, since ONNX has
    no triangular solve. The loop runs over the chunk's rows, so the exported graph does not grow with the length."""
    if torch.onnx.is_in_onnx_export():
        return forward_substitution_inverse(lower)
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device).expand_as(lower)
    return torch.linalg.solve_triangular(lower, eye, upper=False, unitriangular=True)


def forward_substitution_inverse(lower: torch.Tensor) -> torch.Tensor:
    """Row i of (I + L)^-1 is e_i − Σ_{j<i} L_ij · row j: elementwise products and sums only."""
    strictly_lower = lower.tril(-1)
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device).expand_as(lower)
    rows = [eye[..., 0, :]]
    for i in range(1, lower.shape[-1]):
        done = torch.stack(rows, dim=-2)
        rows.append(eye[..., i, :] - (strictly_lower[..., i, :i, None] * done).sum(-2))
    return torch.stack(rows, dim=-2)


def _decay_masks(document_starts: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, ...]:
    """Where a decay product crosses no document start, per chunk [B, 1, N, ...] (a head axis to broadcast over).

    With c the running count of starts inside the chunk, the product from token s to token r (s < r) crosses none
    iff c_r = c_s; from the incoming state to r iff c_r = 0; from s to the chunk's end iff c_s = c_last. The padded
    tail counts no start, so it belongs to the last document.
    """
    starts = F.pad(document_starts, (0, (-document_starts.shape[1]) % chunk_size))
    count = starts.unflatten(1, (-1, chunk_size)).cumsum(-1).unsqueeze(1)
    last = count[..., -1:]
    return count[..., :, None] == count[..., None, :], count == 0, count == last, last == 0


def _chunk_kda(q, k, v, g, beta, initial_state, chunk_size: int, gate_lower_bound: float | None, document_starts):
    batch_size, seq_len, num_heads, k_dim = k.shape
    sub_chunk_size = kda_sub_chunk_size(chunk_size, gate_lower_bound, q.dtype)
    q, k, v, g, beta = (_split_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    gamma = g.cumsum(-2)
    query_key, key_key = kda_intra_chunk_scores(q, k, gamma, sub_chunk_size)
    decay = gamma.exp()
    last = gamma[..., -1:, :]
    keys_to_end = k * (last - gamma).exp()
    chunk_decay = last.transpose(-1, -2).exp()
    if document_starts is not None:
        same_document, from_start, to_end, through_chunk = _decay_masks(document_starts, chunk_size)
        query_key, key_key = query_key * same_document, key_key * same_document
        decay, keys_to_end = decay * from_start[..., None], keys_to_end * to_end[..., None]
        chunk_decay = chunk_decay * through_chunk[..., None]
    transform = unit_lower_triangular_inverse(beta[..., None] * key_key)
    u = transform @ (beta[..., None] * v)
    w = transform @ (beta[..., None] * k * decay)
    keys_to_end = keys_to_end.transpose(-1, -2)
    state = (
        q.new_zeros(batch_size, num_heads, k_dim, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    )
    # unbind, not indexing: the backward of per-chunk indexing writes a full-size zero gradient for every chunk.
    incoming_states, new_values = [], []
    for u_n, w_n, keys_n, decay_n in zip(u.unbind(2), w.unbind(2), keys_to_end.unbind(2), chunk_decay.unbind(2)):
        incoming_states.append(state)
        new_values.append(u_n - w_n @ state)
        state = state * decay_n + keys_n @ new_values[-1]
    new_values = torch.stack(new_values, dim=2)
    output = (q * decay) @ torch.stack(incoming_states, dim=2) + query_key @ new_values
    return output.flatten(2, 3)[:, :, :seq_len].transpose(1, 2), state


# The torch bodies of the model file's kernel seams, in the call conventions of fla 0.6 (`chunk_kda`,
# `fused_recurrent_kda`) and Dao-AILab causal-conv1d (`causal_conv1d_fn`).
def _normalized_queries_keys(q, k, scale: float | None, use_qk_l2norm_in_kernel: bool):
    """fp32 q and k, L2-normalised when asked (fla normalises in the kernel), q times ``scale`` (default K^-1/2)."""
    q, k = upcast(q), upcast(k)
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def torch_chunk_kimi_delta_attention(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    safe_gate=False, lower_bound=None, document_starts=None,
):
    """The torch body of the `chunk_kimi_delta_attention` seam: fla 0.6's ``chunk_kda`` call over `chunk_kda`. q, k
    [B, T, H, K], v [B, T, H, V], the log-decay g [B, T, H, K] (computed, not in-kernel), beta [B, T, H], an fp32
    state [B, H, K, V].

    ``safe_gate`` with ``lower_bound`` is the caller's promise that g >= lower_bound (K3's gate), which lets the
    chunks use sub-chunks of scores. ``document_starts`` [B, T] is this body's own: fla keeps packed documents apart
    by ``cu_seqlens`` over a flattened batch, which transformers' decorator refuses without fla.
    """
    q, k = _normalized_queries_keys(q, k, scale, use_qk_l2norm_in_kernel)
    bound = lower_bound if safe_gate else None
    output, state = chunk_kda(
        q, k, upcast(v), upcast(g), upcast(beta), initial_state, gate_lower_bound=bound, document_starts=document_starts
    )
    return output.to(v.dtype), state if output_final_state else None


def torch_recurrent_kimi_delta_attention(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False
):
    """The torch body of the `recurrent_kimi_delta_attention` seam: fla 0.6's ``fused_recurrent_kda`` call over
    `recurrent_kda` (decoding: one sequence per row, never packed)."""
    q, k = _normalized_queries_keys(q, k, scale, use_qk_l2norm_in_kernel)
    output, state = recurrent_kda(q, k, upcast(v), upcast(g), upcast(beta), initial_state)
    return output.to(v.dtype), state if output_final_state else None


def torch_causal_conv1d_fn(x, weight, bias=None, activation=None, document_positions=None):
    """The torch body of the `causal_conv1d_fn` seam, Dao-AILab causal-conv1d's ``causal_conv1d_fn`` call: the
    depthwise causal convolution (left zero padding) of x [B, C, W] with weight [C, K], then ``activation``.

    ``document_positions`` [B, T] is this body's own (each of the last T tokens' index inside its packed document):
    it keeps every tap inside the token's document and returns those T outputs.
    """
    x = F.pad(x.to(weight.dtype), (weight.shape[-1] - 1, 0))
    if document_positions is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, groups=x.shape[1])
    else:
        out = _conv_within_documents(x, weight, document_positions)
        out = out if bias is None else out + bias[:, None]
    return out if activation is None else ACT2FN[activation](out)


def _conv_within_documents(x: torch.Tensor, weight: torch.Tensor, document_positions: torch.Tensor) -> torch.Tensor:
    """The sums of ``conv1d`` tap by tap, Σ_j w[K−1−j] · x[t−j] · [position_t ≥ j]: tap j reads j tokens back, and is
    kept only where that stays inside the token's document."""
    kernel_size, seq_len, width = weight.shape[-1], document_positions.shape[1], x.shape[-1]

    def tap(lag: int) -> torch.Tensor:
        inside = (document_positions >= lag)[:, None].to(x.dtype)
        return weight[:, kernel_size - 1 - lag, None] * x[..., width - lag - seq_len : width - lag] * inside

    return sum(tap(lag) for lag in range(kernel_size))
