"""Stand-in for Dao-AILab's causal-conv1d: ``causal_conv1d_fn(x, weight, bias, seq_idx, initial_states,
return_final_states, final_states_out, activation)`` with the package's argument names, for whole rows (no
``seq_idx`` or states), computed in float64: the depthwise causal convolution of x [B, D, L] with weight [D, W], then
SiLU for ``activation="silu"``. Each call is appended to ``CALLS``."""

import torch.nn.functional as F

CALLS: list[dict] = []


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if seq_idx is not None or initial_states is not None or return_final_states:
        raise NotImplementedError("the stand-in convolves whole rows only")
    if weight.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [channels={x.shape[1]}, width], got {tuple(weight.shape)}")
    CALLS.append({"shape": tuple(x.shape), "width": weight.shape[-1], "activation": activation, "bias": bias is not None})
    width = weight.shape[-1]
    out = F.conv1d(F.pad(x.double(), (width - 1, 0)), weight.double()[:, None],
                   None if bias is None else bias.double(), groups=x.shape[1])
    return (out if activation is None else F.silu(out)).to(x.dtype)
