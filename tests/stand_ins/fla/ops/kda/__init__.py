"""Stand-in for fla 0.6's ``fla.ops.kda``: ``chunk_kda`` and ``fused_recurrent_kda`` with fla's names for the
arguments a caller passes, fla's documented contract checked (``fla/ops/kda/chunk.py``: a flattened batch of one row
under ``cu_seqlens``, an fp32 initial state per sequence, gates at or above ``lower_bound`` under ``safe_gate``), and the
delta rule evaluated token by token in float64 (Kimi Linear, arXiv:2510.26692, Eq. 1). Each call is appended to
``CALLS`` with the arguments it got."""

import torch

CALLS: list[dict] = []


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, safe_gate=False, lower_bound=None,
              cu_seqlens=None, **kwargs):
    if safe_gate and lower_bound is not None and bool((g < lower_bound).any()):
        raise ValueError(f"safe_gate promises g >= lower_bound={lower_bound}, got a gate down to {g.min().item()}")
    _record("chunk_kda", q, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            cu_seqlens, safe_gate=safe_gate, lower_bound=lower_bound)
    return _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        lower_bound=None, cu_seqlens=None, **kwargs):
    _record("fused_recurrent_kda", q, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, cu_seqlens, lower_bound=lower_bound)
    return _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _record(kernel, q, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            cu_seqlens, **extra):
    if use_gate_in_kernel:
        raise NotImplementedError("the stand-in takes computed gates only (use_gate_in_kernel=False)")
    sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
    if initial_state is not None and (initial_state.dtype != torch.float32 or initial_state.shape[0] != sequences):
        raise ValueError(f"initial_state must be fp32 with one state per sequence ({sequences}), got "
                         f"{initial_state.dtype} {tuple(initial_state.shape)}")
    CALLS.append({
        "kernel": kernel, "shape": tuple(q.shape), "scale": scale, "output_final_state": output_final_state,
        "initial_state": None if initial_state is None else tuple(initial_state.shape),
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
        "cu_seqlens": None if cu_seqlens is None else cu_seqlens.tolist(), **extra,
    })


def _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens):
    """o [B, T, H, V] in v's dtype and the fp32 final states [N, H, K, V], from float64 arithmetic."""
    dtype = v.dtype
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if l2norm:  # fla's l2norm: x / sqrt(sum(x^2) + 1e-6)
        q, k = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outputs, finals = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):  # under cu_seqlens the batch is one row
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        if initial_state is not None:
            state = (initial_state if cu_seqlens is None else initial_state[n : n + 1]).double()
        for t in range(start, end):
            state = state * g[:, t].exp()[..., None]
            error = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])
            state = state + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], error)
            outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
        finals.append(state)
    output = torch.stack(outputs, dim=1).to(dtype)
    return output, torch.cat(finals).float() if output_final_state else None
