"""PyTorch Kimi K3 text model: Kimi Delta Attention + Gated MLA, Block Attention Residuals, Stable LatentMoE.

Top-down like the architecture: norms and SiTU, KDA kernel seams and layer, Gated MLA, Block Attention Residuals,
router, experts, LatentMoE block, decoder layer, models; attribute names are the released checkpoint's state-dict
names (``moonshotai/Kimi-K3``). References: the Kimi K3 technical report (arXiv:2607.24653; "K3 report" below), Kimi
Linear (arXiv:2510.26692) and flash-linear-attention's ``fla/ops/kda``, DeepSeek-V2 (arXiv:2405.04434) for MLA, Gated
Attention (arXiv:2505.06708), Attention Residuals (arXiv:2603.15031), and transformers' ``modeling_kimi_linear.py``.

The file imports only torch, transformers and its sibling files (configuration, checkpoint format, KDA kernels, packed
documents), so a saved folder loads with ``trust_remote_code=True``. Training code attaches from outside, through the
seams the modules declare (the repository's ``docs/attachments.md``).
"""

import functools
import importlib
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationConfig, GenerationMixin, GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList
from transformers.integrations import (
    use_experts_implementation,
    use_kernel_forward_from_hub,
    use_kernel_func_from_hub_with_fallback,
    use_kernelized_func,
)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

try:
    from .checkpoint_format_kimi_k3 import fuse_per_expert_weights, register_expert_layout
    from .configuration_kimi_k3 import KimiK3Config
    from .kda_kimi_k3 import (
        kda_decay_gate,
        torch_causal_conv1d_fn,
        torch_chunk_kimi_delta_attention,
        torch_recurrent_kimi_delta_attention,
        upcast,
    )
    from .loading_kimi_k3 import STRICT_LOADING, check_local_folder, load_checkpoint
    from .packing_kimi_k3 import (
        check_continues_the_cache,
        packed_document_starts,
        packed_prompt_markers,
        positions_in_documents,
        same_document,
    )
except ImportError:
    from checkpoint_format_kimi_k3 import fuse_per_expert_weights, register_expert_layout
    from configuration_kimi_k3 import KimiK3Config
    from kda_kimi_k3 import (
        kda_decay_gate,
        torch_causal_conv1d_fn,
        torch_chunk_kimi_delta_attention,
        torch_recurrent_kimi_delta_attention,
        upcast,
    )
    from loading_kimi_k3 import STRICT_LOADING, check_local_folder, load_checkpoint
    from packing_kimi_k3 import (
        check_continues_the_cache,
        packed_document_starts,
        packed_prompt_markers,
        positions_in_documents,
        same_document,
    )

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`. Remote code runs under
# whatever version the user has, so the model returns the cache under the running version's field name and accepts
# it under either argument name: where `cache` is the name, `past_key_values` warns that it is deprecated, as
# transformers' own models do with `deprecate_kwarg`; where `past_key_values` is still the name, it is taken silently.
CACHE_FIELD = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def accepts_legacy_cache_name(forward: Callable) -> Callable:
    if CACHE_FIELD == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache", raise_if_both_names=True)(forward)
    return forward


def take_cache_argument(cache: Cache | None, kwargs: dict) -> Cache | None:
    """The cache passed as `cache` (transformers >= 5.24) or as `past_key_values` (earlier versions), popped from kwargs."""
    legacy = kwargs.pop("past_key_values", None)
    if cache is not None and legacy is not None:
        raise ValueError("Pass the cache once, as `cache` or as `past_key_values`, not both.")
    return legacy if cache is None else cache


# ---------------------------------------------------------------------------------------------------------------------
# Norms and activations (K3 report §2.3.2)
# ---------------------------------------------------------------------------------------------------------------------
class KeepsFloat32Tensors(nn.Module):
    """Base of modules whose ``float32_tensors`` stay fp32 when the model is cast to 16 bits.

    Router bias, KDA decay parameters, short convolutions and the gated output norm are precision-critical (Kimi K3
    report §2; Kimi Linear). ``from_pretrained(dtype=...)`` keeps them fp32 through ``_keep_in_fp32_modules_strict``;
    ``.to(torch.bfloat16)``, ``.half()`` and ``.bfloat16()`` would round them, so here they only change device. Casts
    up (``.double()``) still apply.
    """

    float32_tensors: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        if recurse:
            for child in self.children():
                child._apply(fn)
        kept = [getattr(self, name) for name in self.float32_tensors]
        kept += [tensor.grad for tensor in kept if tensor.grad is not None]

        def keep_float32(tensor: torch.Tensor) -> torch.Tensor:
            applied = fn(tensor)
            narrowed = applied.is_floating_point() and applied.dtype.itemsize < tensor.dtype.itemsize
            if narrowed and any(tensor is k for k in kept):
                return tensor.to(applied.device)
            return applied

        return super()._apply(keep_float32, recurse=False)


@use_kernel_forward_from_hub("RMSNorm")
class KimiK3RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype *before* the weight multiply, as the released code.

    A seam, as in transformers' ``kimi_linear``: ``from_pretrained(..., use_kernels=True)`` replaces the forward with
    the hub's "RMSNorm" kernel for the device; this body is the reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = upcast(hidden_states)
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


@use_kernel_forward_from_hub("RMSNormGated")
class KimiK3GatedRMSNorm(KeepsFloat32Tensors):
    """Per-head RMSNorm followed by a sigmoid output gate, all in fp32 (KDA output, Kimi Linear §3).

    The "RMSNormGated" seam of transformers' ``kimi_linear`` (fla's fused norm and gate from the hub under
    ``use_kernels=True``, whose forward reads ``activation``); this body is the reference."""

    float32_tensors = ("weight",)
    activation = "sigmoid"

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, dtype=torch.float32))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = gate.dtype
        hidden_states = upcast(hidden_states)
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (upcast(self.weight) * hidden_states * torch.sigmoid(upcast(gate))).to(input_dtype)


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None,
                 tanh: Callable[[torch.Tensor], torch.Tensor] = torch.tanh) -> torch.Tensor:
    """SiTU-GLU: β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂), in fp32 (K3 report Eq. 12); |out| <= β₁β₂.

    ``linear_beta=None`` leaves the up branch uncapped, as the released code does when the field is missing. ``tanh``
    evaluates the caps: a compiled training kernel passes one its compiler makes fast code of.
    """
    gate, up, dtype = upcast(gate), upcast(up), gate.dtype
    activated_gate = beta * tanh(gate / beta) * torch.sigmoid(gate)
    capped_up = up if linear_beta is None else linear_beta * tanh(up / linear_beta)
    return (activated_gate * capped_up).to(dtype)


class KimiK3GLUActivation(nn.Module):
    """The gated activation of the dense MLP, the shared experts and the routed experts: the one module every GLU goes
    through, so a kernel attached here serves them all.

    The body is the eager reference; ``kimi_k3.kernels.fused_situ`` swaps in compiled kernels for training.
    """

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.beta = config.activation_situ_beta if config.activation_situ_beta is not None else 1.0
        self.linear_beta = config.activation_situ_linear_beta
        self.act_fn = None if config.hidden_act == "situ" else ACT2FN[config.hidden_act]

    def forward(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """``up=None``: ``gate`` is the routed experts' concatenated ``[gate ‖ up]``."""
        if up is None:
            gate, up = gate.chunk(2, dim=-1)
        if self.act_fn is not None:
            return self.act_fn(gate) * up
        return situ_and_mul(gate, up, self.beta, self.linear_beta)


class KimiK3MLP(nn.Module):
    """Dense GLU feed-forward: layer 0's ``mlp`` and the MoE ``shared_experts``."""

    def __init__(self, config: KimiK3Config, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.glu = KimiK3GLUActivation(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(hidden_states), self.up_proj(hidden_states)))


# ---------------------------------------------------------------------------------------------------------------------
# Kernel seams, named as transformers' `modeling_kimi_linear.py` names them. Where a kernel package is installed and
# runs on the tensors' device, the seam calls it: flash-linear-attention's Triton KDA (`fla.ops.kda`), Dao-AILab's
# causal-conv1d; under `from_pretrained(..., use_kernels=True)` transformers' `kernels` integration may put a hub
# kernel there instead, or transformers' fallback runs the torch body. Everywhere else (CPUs first) the torch body
# runs directly, and it keeps packed documents apart inside the chunk structure, where transformers' own fallback
# refuses packed rows.
# ---------------------------------------------------------------------------------------------------------------------
# The device types each package's kernels take, as transformers 5.25 decides (ROCm tensors report "cuda").
KERNEL_PACKAGE_DEVICE_TYPES = {"fla": ("cuda", "xpu", "mlu", "npu"), "causal_conv1d": ("cuda",)}
# The function each package is looked up by, where transformers' seams find it.
KERNEL_PACKAGE_ENTRY_POINTS = {"fla": ("fla.ops.kda", "chunk_kda"), "causal_conv1d": ("causal_conv1d", "causal_conv1d_fn")}


def _imports(module: str, name: str) -> bool:
    """Whether ``module.name`` imports; a package whose import fails (Triton without a GPU driver, say) counts as
    absent, as in transformers' seams."""
    try:
        return hasattr(importlib.import_module(module), name)
    except Exception:
        return False


INSTALLED_KERNEL_PACKAGES = frozenset(
    package for package, entry_point in KERNEL_PACKAGE_ENTRY_POINTS.items() if _imports(*entry_point)
)


def goes_through_seams(package: str, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` goes through ``package``'s seams: it is on a device type the package's kernels run on.

    Decided here rather than by transformers' decorator: before 5.25 it hands tensors on any device to an installed
    package (a CPU tensor would reach Triton). A test changes `KERNEL_PACKAGE_DEVICE_TYPES` to send CPU tensors to a
    stand-in package."""
    return tensor.device.type in KERNEL_PACKAGE_DEVICE_TYPES[package]


def package_kernel_runs(package: str, tensor: torch.Tensor) -> bool:
    """Whether ``package`` itself takes ``tensor``: installed, and on a device type its kernels run on. Packed rows
    go through a seam only then (as ``cu_seqlens``); transformers' fallback would refuse them."""
    return package in INSTALLED_KERNEL_PACKAGES and goes_through_seams(package, tensor)


# The seams, as transformers declares them (with `kernels` installed each is a module that `kernelize` can swap, so the
# torch bodies, in kda_kimi_k3.py, keep their own names, for the calls that must reach them).
chunk_kimi_delta_attention = use_kernel_func_from_hub_with_fallback("chunk_kda", "fla")(
    torch_chunk_kimi_delta_attention
)
recurrent_kimi_delta_attention = use_kernel_func_from_hub_with_fallback("fused_recurrent_kda", "fla")(
    torch_recurrent_kimi_delta_attention
)


def kda_through_fla_packed(q, k, v, g, beta, document_starts, **arguments):
    """`chunk_kimi_delta_attention` on fla's variable-length layout: the rows flattened into one, each document a
    sequence of ``cu_seqlens``, from a zero state (packed rows never continue a cache); a row's outgoing state is its
    last document's."""
    batch_size, seq_len = document_starts.shape
    sequence_starts = torch.cat([document_starts.new_ones(batch_size, 1), document_starts[:, 1:]], dim=1)
    boundaries = F.pad(sequence_starts.flatten().nonzero().flatten(), (0, 1), value=batch_size * seq_len)
    last_of_row = sequence_starts.sum(-1).cumsum(0) - 1
    flat = (x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, g, beta))
    output, state = chunk_kimi_delta_attention(*flat, cu_seqlens=boundaries, **arguments)
    return output.view(batch_size, seq_len, *output.shape[2:]), None if state is None else state[last_of_row]


causal_conv1d_fn = use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")(torch_causal_conv1d_fn)


class KimiK3ShortConvolution(KeepsFloat32Tensors, nn.Conv1d):
    """Depthwise causal convolution + SiLU (always SiLU, not ``hidden_act``) of KDA's q/k/v, in fp32."""

    float32_tensors = ("weight",)

    def __init__(self, channels: int, kernel_size: int):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor, document_positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, C, context + T] -> [B, C, context + T], causal by left zero padding; one group per channel of x.

        ``document_positions`` [B, T] (each token's index inside its packed document) limits every output to taps
        inside its own document; the result is then the last T outputs, [B, C, T]. Through the `causal_conv1d_fn`
        seam: causal-conv1d's kernel where it runs (whole rows), its torch body otherwise.
        """
        weight = self.weight.squeeze(1)
        if document_positions is None and goes_through_seams("causal_conv1d", x):
            return causal_conv1d_fn(x.to(weight.dtype), weight, activation="silu")
        return torch_causal_conv1d_fn(x, weight, activation="silu", document_positions=document_positions)


@use_kernelized_func([chunk_kimi_delta_attention, recurrent_kimi_delta_attention, causal_conv1d_fn])
class KimiK3DeltaAttention(KeepsFloat32Tensors):
    """Kimi Delta Attention with K3's lower-bounded sigmoid decay and full-rank output gate (K3 report §2.1)."""

    float32_tensors = ("A_log", "dt_bias")

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.gate_lower_bound = float(config.linear_gate_lower_bound)
        projection_size = self.num_heads * self.head_dim
        hidden_size = config.hidden_size

        self.q_proj = nn.Linear(hidden_size, projection_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, projection_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, projection_size, bias=False)
        self.q_conv1d = KimiK3ShortConvolution(projection_size, self.conv_kernel_size)
        self.k_conv1d = KimiK3ShortConvolution(projection_size, self.conv_kernel_size)
        self.v_conv1d = KimiK3ShortConvolution(projection_size, self.conv_kernel_size)
        self.f_a_proj = nn.Linear(hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, projection_size, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(projection_size, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden_size, self.num_heads, bias=False)
        self.g_proj = nn.Linear(hidden_size, projection_size, bias=False)
        self.o_norm = KimiK3GatedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(projection_size, hidden_size, bias=False)

    def _causal_conv(
        self, x: torch.Tensor, conv: KimiK3ShortConvolution, cache: Cache | None, state_idx: int,
        document_positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Short convolution of x [B, T, C], continuing from the cached left context."""
        seq_len = x.shape[1]
        x = x.transpose(1, 2)
        if cache is not None:
            x = cache.update_conv_state(x, self.layer_idx, state_idx=state_idx, conv_kernel_size=self.conv_kernel_size)
        return conv(x, document_positions)[..., -seq_len:].transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        document_starts: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """``document_starts`` [B, T] (packed documents, see `packed_document_starts`) restarts the short convolutions
        and the state at the first token of every document."""
        batch_size, seq_len, _ = hidden_states.shape
        if attention_mask is not None:
            # Padding must not reach the short convolutions of real tokens.
            hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)
        head_shape = (batch_size, seq_len, -1, self.head_dim)
        previous_state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        positions = None if document_starts is None else positions_in_documents(document_starts)

        q = self._causal_conv(self.q_proj(hidden_states), self.q_conv1d, cache, 0, positions).reshape(head_shape)
        k = self._causal_conv(self.k_proj(hidden_states), self.k_conv1d, cache, 1, positions).reshape(head_shape)
        v = self._causal_conv(self.v_proj(hidden_states), self.v_conv1d, cache, 2, positions).reshape(head_shape)
        g = kda_decay_gate(self.f_b_proj(self.f_a_proj(hidden_states)), self.A_log, self.dt_bias, self.gate_lower_bound)
        beta = torch.sigmoid(upcast(self.b_proj(hidden_states)))
        if attention_mask is not None:
            # A padded position neither decays nor writes the state: it is an exact no-op on the recurrence.
            valid = attention_mask.to(torch.float32)
            g = g * valid[..., None, None]
            beta = beta * valid[..., None]

        core, final_state = self.delta_rule(q, k, upcast(v), g, beta, previous_state, document_starts, cache is not None)
        if cache is not None:
            cache.update_recurrent_state(final_state, self.layer_idx)

        gate = self.g_proj(hidden_states).reshape(head_shape)
        output = self.o_norm(core, gate).reshape(batch_size, seq_len, -1)
        return self.o_proj(output), None

    def delta_rule(self, q, k, v, g, beta, previous_state, document_starts, keep_state: bool):
        """The KDA recurrence through the seams, with K3's arguments mapped onto fla's: q and k L2-normalised in the
        kernel and q scaled by head_dim^-1/2, the computed gate with its lower bound (``safe_gate``), the cached state
        in and out, packed documents as ``cu_seqlens``. On a device fla runs on (`goes_through_seams`) the seams take
        whole rows, and packed rows where fla is installed; otherwise the torch bodies run, resetting the state at
        ``document_starts`` themselves."""
        through_seams = goes_through_seams("fla", q)
        arguments = {"scale": self.head_dim**-0.5, "initial_state": previous_state, "output_final_state": keep_state,
                     "use_qk_l2norm_in_kernel": True}
        if previous_state is not None and q.shape[1] == 1:
            decode = recurrent_kimi_delta_attention if through_seams else torch_recurrent_kimi_delta_attention
            return decode(q, k, v, g, beta, **arguments)
        arguments.update(safe_gate=True, lower_bound=self.gate_lower_bound)
        if through_seams and document_starts is None:
            return chunk_kimi_delta_attention(q, k, v, g, beta, **arguments)
        if through_seams and package_kernel_runs("fla", q):
            arguments.pop("initial_state")  # None: packed documents never continue a cache
            return kda_through_fla_packed(q, k, v, g, beta, document_starts, **arguments)
        return torch_chunk_kimi_delta_attention(q, k, v, g, beta, document_starts=document_starts, **arguments)


# ---------------------------------------------------------------------------------------------------------------------
# Gated MLA (DeepSeek-V2 §2.1, K3 report §2.1.2 Eq. 7)
# ---------------------------------------------------------------------------------------------------------------------
def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Reference attention: scores in the working dtype, softmax in fp32, as transformers' eager attention."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = F.softmax(upcast(scores), dim=-1).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


class KimiK3MLAAttention(nn.Module):
    """Multi-head Latent Attention with NoPE and a sigmoid output gate.

    The 64 "rope" dimensions are extra, never-rotated content channels (the release uses NoPE). The cache holds
    the compressed latent (normed c_kv and the shared k_r); decoding steps attend in the absorbed form, where
    ``kv_b_proj`` is folded into the query and the output instead of expanding every cached token.
    """

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.scaling = self.qk_head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.num_key_value_groups = 1
        hidden_size = config.hidden_size

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, self.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiK3RMSNorm(self.q_lora_rank)  # eps 1e-6, as released
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.g_proj = (
            nn.Linear(hidden_size, self.num_heads * self.v_head_dim, bias=False)
            if config.mla_use_output_gate
            else None
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden_size, bias=False)
        # Called with (module, queries, keys) in full-sequence forwards; QK-Clip attaches its logit recorder here.
        self.query_key_observer: Callable | None = None

    def project_queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            queries = self.q_proj(hidden_states)
        else:
            queries = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        return queries.unflatten(-1, (-1, self.qk_head_dim)).transpose(1, 2)

    def compress_key_values(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token latent the cache stores: normed c_kv [B, 1, T, kv_lora] and shared k_r [B, 1, T, rope]."""
        latent, shared_key = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        return self.kv_a_layernorm(latent).unsqueeze(1), shared_key.unsqueeze(1)

    def expand_key_values(self, latent: torch.Tensor, shared_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full keys [B, H, S, nope+rope] (k_r broadcast to every head, unrotated) and values [B, H, S, v]."""
        key_values = self.kv_b_proj(latent.squeeze(1))
        key_values = key_values.unflatten(-1, (-1, self.qk_nope_head_dim + self.v_head_dim)).transpose(1, 2)
        key_nope, values = key_values.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        shared_key = shared_key.expand(-1, key_nope.shape[1], -1, -1)
        return torch.cat([key_nope, shared_key], dim=-1), values

    def absorbed_weights(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into its key part [H, nope, kv_lora] and value part [H, v, kv_lora].

        The matrix is read by applying ``kv_b_proj`` to the identity (exact: every output is one weight times 1), so
        whatever wraps the module (a LoRA adapter, accelerate's offload hooks) acts here as in the expanded form.
        """
        identity = torch.eye(self.kv_lora_rank, dtype=latent.dtype, device=latent.device)
        weight = self.kv_b_proj(identity).T.unflatten(0, (-1, self.qk_nope_head_dim + self.v_head_dim))
        return weight.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch_size, seq_len, _ = hidden_states.shape
        queries = self.project_queries(hidden_states)
        latent, shared_key = self.compress_key_values(hidden_states)
        if cache is not None:
            latent, shared_key = cache.update(latent, shared_key, self.layer_idx)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attend = self._attend_absorbed if latent.shape[2] > seq_len else self._attend_expanded
        attn_output, attn_weights = attend(attention_interface, queries, latent, shared_key, attention_mask, **kwargs)
        attn_output = attn_output.reshape(batch_size, seq_len, -1)
        if self.g_proj is not None:
            # The gate reads the normed layer input, not the attention output (K3 report Eq. 7).
            attn_output = attn_output * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(attn_output), attn_weights

    def _attend_expanded(self, attention_interface, queries, latent, shared_key, attention_mask, **kwargs):
        keys, values = self.expand_key_values(latent, shared_key)
        if self.query_key_observer is not None:
            self.query_key_observer(self, queries, keys)
        dropout = self.attention_dropout if self.training else 0.0
        return self._attention(attention_interface, queries, keys, values, attention_mask, dropout, **kwargs)

    def _attend_absorbed(self, attention_interface, queries, latent, shared_key, attention_mask, **kwargs):
        """Attention over the cached latent: q·k_nope = (W_ukᵀ q)·c_kv, and W_uv is applied after the softmax."""
        key_weight, value_weight = self.absorbed_weights(latent)
        query_nope, query_rope = queries.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        absorbed_query = torch.cat([torch.einsum("bhtn,hnc->bhtc", query_nope, key_weight), query_rope], dim=-1)
        keys = torch.cat([latent, shared_key], dim=-1).expand(-1, queries.shape[1], -1, -1)
        values = latent.expand(-1, queries.shape[1], -1, -1)
        latent_output, attn_weights = self._attention(
            attention_interface, absorbed_query, keys, values, attention_mask, 0.0, **kwargs
        )
        with torch.autocast(latent_output.device.type, enabled=False):
            value_weight = value_weight.to(torch.promote_types(value_weight.dtype, latent_output.dtype))
            return torch.einsum("bthc,hvc->bthv", latent_output, value_weight), attn_weights

    def _attention(self, attention_interface, query, key, value, attention_mask, dropout, **kwargs):
        """The attention interface; under autocast on fp32 copies of q/k/v with autocast off, so that the output
        reaches the output gate in fp32: K3 keeps the attention output in FP32 in training against the biased
        rounding of low-precision attention outputs (Kimi K3 technical report §2.1.2)."""
        if not torch.is_autocast_enabled(query.device.type):
            return attention_interface(
                self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
            )
        with torch.autocast(query.device.type, enabled=False):
            return attention_interface(
                self, upcast(query), upcast(key), upcast(value), attention_mask, dropout=dropout,
                scaling=self.scaling, **kwargs,
            )


# ---------------------------------------------------------------------------------------------------------------------
# Block Attention Residuals (Attention Residuals, arXiv:2603.15031)
# ---------------------------------------------------------------------------------------------------------------------
class KimiK3PseudoQuery(nn.Linear):
    """The learned pseudo-query of one AttnRes site, a [1, hidden] projection applied in fp32."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1, bias=False)

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        # A product and a sum rather than a GEMV, whose summation order depends on where the weight's memory starts
        # (a memory-mapped checkpoint tensor): logits are then bit-identical however the weight was loaded.
        return (upcast(keys) * upcast(self.weight[0])).sum(-1, keepdim=True)


def block_attention_residual(
    block_sum: torch.Tensor, bank: torch.Tensor, proj: KimiK3PseudoQuery, norm: KimiK3RMSNorm
) -> torch.Tensor:
    """Softmax mix of the block snapshots ``bank`` [..., blocks, hidden] and the running partial sum, in fp32.

    The logits are ``proj(norm(values))`` = RMS(values) · (``norm.weight`` ⊙ ``proj.weight[0]``); the mix is over the
    raw (un-normalised) values. Both modules run their own forward, so hooks and adapters on them take part.
    """
    values = upcast(torch.cat([bank, block_sum.unsqueeze(-2)], dim=-2))
    mix = torch.softmax(proj(norm(values)).squeeze(-1), dim=-1)
    return (mix.unsqueeze(-1) * values).sum(-2).to(block_sum.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Stable LatentMoE (K3 report §2.3, Eq. 11 and 13)
# ---------------------------------------------------------------------------------------------------------------------
class KimiK3TopkRouter(KeepsFloat32Tensors):
    """Sigmoid router whose fp32 bias only picks experts; the weights come from the bias-free scores (K3 report
    §2.3.3). It records nothing: a balancing policy reads its outputs through a forward hook and writes
    ``e_score_correction_bias`` between optimizer steps."""

    float32_tensors = ("e_score_correction_bias",)

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.score_function = config.moe_router_activation_func
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns router logits [N, n], routing weights [N, k] (fp32) and expert indices [N, k]."""
        logits = F.linear(upcast(hidden_states), upcast(self.weight))
        scores = logits.sigmoid() if self.score_function == "sigmoid" else logits.softmax(-1)
        with torch.no_grad():
            expert_indices = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_indices)
        if self.renormalize and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, expert_indices

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.weight.shape[1]}, "
                f"score={self.score_function}, renormalize={self.renormalize}, scale={self.routed_scaling_factor}")


@use_experts_implementation
class KimiK3Experts(nn.Module):
    """Routed SiTU-GLU experts in the latent space, fused into 3-D tensors for transformers' experts backends.

    ``gate_up_proj[e]`` stacks the released ``experts.{e}.w1`` (gate) over ``w3`` (up); ``down_proj[e]`` is ``w2``.
    The per-expert loop below is the reference (``experts_implementation="eager"``); it combines in fp32.
    """

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.routed_expert_hidden_size or config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.glu = KimiK3GLUActivation(config)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}"

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        # transformers' experts backends call this with the concatenated [gate ‖ up]; it goes to the activation whole.
        return self.glu(gate_up_out)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Also accept the released per-expert keys (``{e}.w1/w3/w2.weight``) in plain ``load_state_dict``.

        ``from_pretrained`` fuses them through the conversion mapping, but code that loads a ``model.safetensors``
        with ``load_state_dict`` (``Trainer``'s checkpoint resume, for one) would otherwise leave the fused
        tensors missing and silently keep their initial values. A layer whose experts are only partly present
        (a shard boundary inside it) is an error, never a silent partial load.
        """
        error = fuse_per_expert_weights(state_dict, prefix, self.num_experts)
        if error is not None:
            error_msgs.append(error)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return per_expert_loop(
            self.gate_up_proj, self.down_proj, self._apply_gate, hidden_states, top_k_index, top_k_weights
        )


def per_expert_loop(gate_up_proj, down_proj, apply_gate, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """The routed experts one at a time, combined in fp32: the reference the experts backends are tested against,
    a function of the fused tensors so that experts which materialise them (a shared basis) run it too."""
    combined = upcast(hidden_states.new_zeros(hidden_states.shape))
    for expert in top_k_index.unique().tolist():
        token_idx, slot = torch.where(top_k_index == expert)
        expert_out = F.linear(hidden_states[token_idx], gate_up_proj[expert])
        expert_out = F.linear(apply_gate(expert_out), down_proj[expert])
        combined.index_add_(0, token_idx, upcast(expert_out) * top_k_weights[token_idx, slot, None])
    return combined.to(hidden_states.dtype)


class KimiK3SparseMoeBlock(nn.Module):
    """Stable LatentMoE: y = shared(x) + W↑·RMSNorm(Σ p_i E_i(W↓x)) (K3 report Eq. 11)."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        latent_size = config.routed_expert_hidden_size
        self.gate = KimiK3TopkRouter(config)
        if latent_size is not None:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, latent_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent_size, config.hidden_size, bias=False)
        else:
            self.routed_expert_down_proj = self.routed_expert_up_proj = nn.Identity()
        self.experts = KimiK3Experts(config)
        self.routed_expert_norm = (
            KimiK3RMSNorm(latent_size or config.hidden_size, eps=config.rms_norm_eps)
            if config.latent_moe_use_norm
            else nn.Identity()
        )
        self.shared_experts = (
            KimiK3MLP(config, intermediate_size=config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, routing_weights, expert_indices = self.gate(tokens)
        experts = self.experts
        if torch.onnx.is_in_onnx_export():  # ONNX translates batched products, not grouped ones or a per-expert loop
            experts = functools.partial(ALL_EXPERTS_FUNCTIONS["batched_mm"], self.experts)
        latent = experts(self.routed_expert_down_proj(tokens), expert_indices, routing_weights)
        routed = self.routed_expert_up_proj(self.routed_expert_norm(latent)).view_as(hidden_states)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(hidden_states)


# ---------------------------------------------------------------------------------------------------------------------
# Decoder layer and models
# ---------------------------------------------------------------------------------------------------------------------
class KimiK3DecoderLayer(GradientCheckpointingLayer):
    """One K3 layer on the (partial sum, block bank) state of Block Attention Residuals.

    The partial sum and the block snapshots come in as separate positional tensors and only new tensors go out, so
    reentrant gradient checkpointing sees (and returns gradients for) every tensor the layer reads. The model keeps
    the bank; a layer that starts a block returns the snapshot of its input partial sum to add to it.
    """

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.attn_res_block_size = config.attn_res_block_size
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        if self.layer_type == "linear_attention":
            self.self_attn = KimiK3DeltaAttention(config, layer_idx)
        else:
            self.self_attn = KimiK3MLAAttention(config, layer_idx)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.block_sparse_moe = KimiK3SparseMoeBlock(config)
        else:
            self.mlp = KimiK3MLP(config)
        self.input_layernorm = KimiK3RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = KimiK3RMSNorm(hidden_size, eps=eps)
        if self.attn_res_block_size is not None:
            self.self_attention_res_proj = KimiK3PseudoQuery(hidden_size)
            self.self_attention_res_norm = KimiK3RMSNorm(hidden_size, eps=eps)
            self.mlp_res_proj = KimiK3PseudoQuery(hidden_size)
            self.mlp_res_norm = KimiK3RMSNorm(hidden_size, eps=eps)

    # The AttnRes seam: ``kimi_k3.kernels.fused_attention_residual`` swaps in compiled kernels for training.
    attention_residual = staticmethod(block_attention_residual)

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.post_attention_layernorm(hidden_states)
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(hidden_states)
        return self.mlp(hidden_states)

    def forward(
        self,
        block_sum: torch.Tensor,
        *blocks: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor | None, ...]:
        """Returns the new partial sum (the hidden state without AttnRes) and the new block snapshot (None when the
        layer starts no block)."""
        if self.attn_res_block_size is None:
            # Plain pre-norm residual stream (no AttnRes); `block_sum` is then the hidden state.
            mixed, _ = self.self_attn(self.input_layernorm(block_sum), attention_mask, cache=cache, **kwargs)
            hidden_states = block_sum + mixed
            return hidden_states + self.feed_forward(hidden_states), None

        # One stack per layer: each snapshot gets one gradient contribution per layer, summed in the same order
        # whether or not the layer is wrapped (FSDP, checkpointing), so sharded runs match single-process ones bitwise.
        bank = torch.stack(blocks, dim=-2) if blocks else None
        mixer_input = (
            self.attention_residual(block_sum, bank, self.self_attention_res_proj, self.self_attention_res_norm)
            if bank is not None
            else block_sum
        )
        starts_block = self.layer_idx % self.attn_res_block_size == 0
        snapshot = None
        if starts_block:
            snapshot = block_sum.clone()  # a copy: reentrant checkpointing cannot return an input as an output
            bank = snapshot.unsqueeze(-2) if bank is None else torch.cat([bank, snapshot.unsqueeze(-2)], dim=-2)
        mixed, _ = self.self_attn(self.input_layernorm(mixer_input), attention_mask, cache=cache, **kwargs)
        block_sum = mixed if starts_block else block_sum + mixed
        ffn_input = self.attention_residual(block_sum, bank, self.mlp_res_proj, self.mlp_res_norm)
        return block_sum + self.feed_forward(ffn_input), snapshot


class KimiK3PreTrainedModel(PreTrainedModel):
    config: KimiK3Config
    config_class = KimiK3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer"]
    _skip_keys_device_placement = [CACHE_FIELD]
    _supports_sdpa = True
    _supports_flash_attn = False
    # The pseudo-queries compute as a product and a sum of their fp32 weight (`KimiK3PseudoQuery`), not as a linear
    # layer: quantizers that swap weights for their own tensors (torchao, bitsandbytes) leave them alone. Named by
    # parameter, which both the quantizers' skip list (a suffix) and the fp16 dtype plan (a search) match.
    _keep_in_fp32_modules = ["self_attention_res_proj.weight", "mlp_res_proj.weight", "output_attn_res_proj.weight"]
    _keep_in_fp32_modules_strict = [
        "A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm", "e_score_correction_bias"
    ]
    _keys_to_ignore_on_load_unexpected = [r"^vision_tower\.", r"^mm_projector\."]
    # Attention maps come from the MLA layers only, as in transformers' hybrids (Qwen3-Next, Kimi Linear): KDA has
    # no attention map to return.
    _can_record_outputs = {
        "router_logits": OutputRecorder(KimiK3TopkRouter, index=0),
        "hidden_states": OutputRecorder(KimiK3DecoderLayer, index=0),
        "attentions": OutputRecorder(KimiK3MLAAttention, index=1),
    }

    # Whether the class builds the opt-in Stable LatentMoE variants (their subclasses do; this file builds none).
    builds_variants = False

    def __init__(self, config: KimiK3Config, *inputs, **kwargs):
        enabled = getattr(config, "enabled_variants", ())
        if enabled and not self.builds_variants:
            # Built here, the released modules would stand in for the variant's and compute other numbers.
            raise ValueError(
                f"The config switches on {', '.join(enabled)}, which {type(self).__name__} does not build: use the "
                "variant classes (KimiK3VariantForCausalLM, KimiK3VariantModel), or AutoModelForCausalLM with "
                "trust_remote_code=True on a folder saved from one."
            )
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, strict: bool = True, **kwargs):
        """transformers' ``from_pretrained``, refusing a checkpoint that does not hold exactly the model's tensors.

        A local folder's files (config, shard index, every shard it names) must be regular files inside the folder
        (`check_local_folder`). Missing, unexpected or mis-shaped tensors, integer or boolean tensors where the model
        holds floats, and MXFP4 scales that decode to NaN or infinity are named in one ``ValueError`` before any tensor is read.
        ``strict=False`` gives transformers' own lenient behaviour: missing tensors are initialised at random and
        reported in a warning table, stored dtypes are cast.
        """
        folder = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if isinstance(folder, (str, os.PathLike)) and os.path.isdir(folder):
            check_local_folder(os.path.join(folder, kwargs.get("subfolder") or ""))
        token = STRICT_LOADING.set(strict)
        try:
            return super().from_pretrained(*args, **kwargs)
        finally:
            STRICT_LOADING.reset(token)

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
        """Checks the checkpoint, then reads our layout or the released one (``checkpoint_format_kimi_k3``)."""
        return load_checkpoint(
            PreTrainedModel._load_pretrained_model, model, state_dict, checkpoint_files, load_config, expected_keys
        )

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiK3DeltaAttention):
            # Kimi Linear / FLA initialisation: A ~ U(1, 16) per head, dt ~ logU(1e-3, 1e-1) through softplus⁻¹. The
            # logarithms and exponentials run in float64 and round once: in float32 their last bit comes from the CPU's
            # math library (MKL takes another code path on AMD than on Intel), and so would the initial weights.
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).double().log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).double()
            dt = dt.exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, (KimiK3RMSNorm, KimiK3GatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, KimiK3TopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KimiK3Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KimiK3DecoderLayer) and module.attn_res_block_size is not None:
            # Zero pseudo-queries: every AttnRes mix starts uniform (Attention Residuals paper).
            init.zeros_(module.self_attention_res_proj.weight)
            init.zeros_(module.mlp_res_proj.weight)
        elif isinstance(module, KimiK3Model) and module.output_attn_res_proj is not None:
            init.zeros_(module.output_attn_res_proj.weight)


class KimiK3Model(KimiK3PreTrainedModel):
    """The decoder stack. With Block Attention Residuals there is no single residual stream: each layer reads a learned
    mix of the block snapshots. ``output_hidden_states=True`` therefore returns each layer's running block sum (the
    first element of its output state), and ``last_hidden_state`` the normed final mix of all blocks.
    """

    decoder_layer_class = KimiK3DecoderLayer  # what subclasses override to build other layers

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        if config.attn_res_block_size is not None:
            self.output_attn_res_proj = KimiK3PseudoQuery(config.hidden_size)
            self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.output_attn_res_proj = self.output_attn_res_norm = None
        self.norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    attention_residual = staticmethod(block_attention_residual)  # the output's AttnRes: the layers' seam

    @accepts_legacy_cache_name
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        cache = take_cache_argument(cache, kwargs)
        inputs_embeds = self._input_embeddings(input_ids, inputs_embeds)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        _check_cache_type(cache, self.config)
        past_length = _cached_length(cache, self.config)
        self._check_lengths(inputs_embeds, attention_mask, past_length)
        document_starts = packed_document_starts(inputs_embeds, attention_mask, position_ids, kwargs)
        if document_starts is not None and past_length > 0:
            check_continues_the_cache(document_starts, kwargs)
            document_starts = None

        # Positional: the cache parameter of the mask builders is named differently across transformers versions.
        # The model uses no positions (NoPE): position ids only ever mark packed documents, read above.
        mask_args = (self.config, inputs_embeds, attention_mask, cache)
        within_documents = None if document_starts is None else same_document(document_starts)
        masks = {
            "full_attention": create_causal_mask(*mask_args, and_mask_function=within_documents),
            "linear_attention": create_recurrent_attention_mask(*mask_args),
        }

        block_sum, blocks = inputs_embeds, []
        for decoder_layer in self.layers:
            block_sum, snapshot = decoder_layer(
                block_sum,
                *blocks,
                attention_mask=masks[decoder_layer.layer_type],
                cache=cache,
                document_starts=document_starts,
                **kwargs,
            )
            if snapshot is not None:
                blocks.append(snapshot)
        hidden_states = block_sum
        if self.output_attn_res_proj is not None:
            hidden_states = self.attention_residual(
                block_sum, torch.stack(blocks, dim=-2), self.output_attn_res_proj, self.output_attn_res_norm
            )
        return MoeModelOutputWithPast(
            last_hidden_state=self.norm(hidden_states),
            **{CACHE_FIELD: cache},
        )

    def _input_embeddings(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """The embedded tokens, from exactly one of ``input_ids`` and ``inputs_embeds`` (ids of the wrong type, shape
        or range fail in the embedding itself)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        return self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    def _check_lengths(self, inputs_embeds, attention_mask, past_length) -> None:
        batch_size, seq_len = inputs_embeds.shape[:2]
        if past_length + seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"Sequence length {past_length + seq_len} (cached {past_length} + new {seq_len}) exceeds "
                f"`max_position_embeddings`={self.config.max_position_embeddings}."
            )
        if attention_mask is not None and attention_mask.ndim == 2:
            if tuple(attention_mask.shape) != (batch_size, past_length + seq_len):
                raise ValueError(
                    f"`attention_mask` must have shape [batch={batch_size}, cached+new={past_length + seq_len}], "
                    f"got {tuple(attention_mask.shape)}."
                )


def _check_not_assisted(generation_mode: GenerationMode, generation_config: GenerationConfig) -> None:
    """Assisted decoding (a draft model, prompt lookup, early exit; or drafting as ``is_assistant``) rolls the cache
    back past rejected draft tokens, but a KDA layer keeps only the recurrent state after the last token: transformers
    5.25 would crop to a wrong state and decode other tokens than greedy (earlier releases refuse stateful models)."""
    if generation_mode == GenerationMode.ASSISTED_GENERATION or getattr(generation_config, "is_assistant", False):
        raise ValueError(
            "Kimi K3 does not support assisted decoding (`assistant_model`, `prompt_lookup_num_tokens`, "
            "`assistant_early_exit`, or drafting as another model's assistant): its KDA layers' recurrent state cannot "
            "be rolled back to a rejected draft token; generate without them."
        )


def _check_cache_type(cache: Cache | None, config) -> None:
    """KDA layers keep a recurrent state and short-conv windows, which only transformers' DynamicCache (built with
    the model config) holds; fixed-size caches (``cache_implementation="static"`` and the other static kinds) do not.
    Its token count lives in attention (MLA) layers."""
    if cache is None:
        return
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"Kimi K3 decodes with a `DynamicCache(config=model.config)` (the hybrid KDA + MLA cache); got "
            f"{type(cache).__name__}. In `generate`, leave `cache_implementation` unset or use 'dynamic' (or "
            "'offloaded' on a CUDA device); static caches (e.g. `cache_implementation=\"static\"` for torch.compile) "
            "are not supported."
        )
    if not config.mla_layer_indices:
        raise ValueError(
            "This model has no MLA layer (no `full_attention` in `layer_types`) and transformers' cache "
            "counts tokens in attention layers only: call it with `use_cache=False` (`generate` then runs full "
            "forwards)."
        )


def _cached_length(cache: Cache | None, config) -> int:
    """The number of cached tokens, as a Python int read from the first MLA layer's keys: transformers 5.25 counts a
    linear-attention layer's tokens in a 0-dim tensor, which the default ``get_seq_length()`` (layer 0, a KDA layer
    here) returns, and every comparison with it would wait for the device in each training and decoding step."""
    if cache is None:
        return 0
    return cache.get_seq_length(config.mla_layer_indices[0])


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # the model's plan is KimiK3Config.base_model_tp_plan
    base_model_class = KimiK3Model  # what subclasses override to build another decoder stack

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """transformers' check of ``generate``'s model arguments, refusing packed prompts: generation decodes one
        sequence per row, and a row of packed documents would continue its last document with the others' tokens."""
        markers = packed_prompt_markers(model_kwargs)
        if markers:
            raise ValueError(
                f"generate() got packed documents ({markers}); give each prompt its own row (padded, with an "
                "`attention_mask`)."
            )
        super()._validate_model_kwargs(model_kwargs)

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs) -> None:
        """transformers' check of the decoding mode, refusing what the KDA state cannot do: assisted decoding, and a
        cache without MLA layers (refused before transformers asks that cache for its length)."""
        _check_not_assisted(generation_mode, generation_config)
        if generation_config.use_cache and not self.config.mla_layer_indices:
            _check_cache_type(DynamicCache(config=self.config), self.config)
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _get_stopping_criteria(self, generation_config: GenerationConfig, *args, **kwargs) -> StoppingCriteriaList:
        """transformers' stopping criteria, stopping at ``max_position_embeddings`` too: transformers only warns
        there, and the next forward would refuse the sequence in the middle of generation."""
        criteria = super()._get_stopping_criteria(generation_config, *args, **kwargs)
        limit = self.config.max_position_embeddings
        if generation_config.max_length is not None and generation_config.max_length > limit:
            logger.warning_once(
                f"This is a friendly reminder - the current text generation call would exceed the model's predefined "
                f"maximum length ({limit}): generation stops at {limit} tokens."
            )
            criteria.append(MaxLengthCriteria(max_length=limit))
        return criteria

    @accepts_legacy_cache_name
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=take_cache_argument(cache, kwargs),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )


class KimiK3TaskHead:
    """What transformers' generic task heads need from a Kimi K3 model: their ``AutoModel.from_config`` finds
    `KimiK3Model` (registered for the config's class, which under remote code is its own module's copy, so no
    remote-code lookup happens), and loading a causal-LM folder initialises the new ``score`` head and leaves
    ``lm_head`` unread, while a missing base-model tensor is still refused by strict loading."""

    _keys_to_ignore_on_load_missing = ["score.weight", "score.bias"]
    _keys_to_ignore_on_load_unexpected = [*KimiK3PreTrainedModel._keys_to_ignore_on_load_unexpected, r"^lm_head\."]

    def __init__(self, config: KimiK3Config):
        AutoModel.register(type(config), KimiK3Model, exist_ok=True)
        super().__init__(config)


class KimiK3ForSequenceClassification(KimiK3TaskHead, GenericForSequenceClassification, KimiK3PreTrainedModel):
    """One label (or regression value) per sequence, scored at its last non-padding token (transformers' generic
    head, as for its own decoder models)."""


class KimiK3ForTokenClassification(KimiK3TaskHead, GenericForTokenClassification, KimiK3PreTrainedModel):
    """One label per token (transformers' generic head)."""


class KimiK3ForQuestionAnswering(KimiK3TaskHead, GenericForQuestionAnswering, KimiK3PreTrainedModel):
    """Extractive question answering: a start and an end score per token (transformers' generic head)."""

    _keys_to_ignore_on_load_missing = ["qa_outputs.weight", "qa_outputs.bias"]


register_expert_layout(
    "KimiK3ForCausalLM", "KimiK3Model", "KimiK3ForSequenceClassification", "KimiK3ForTokenClassification",
    "KimiK3ForQuestionAnswering",
)
KimiK3Model.register_for_auto_class("AutoModel")
KimiK3ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
KimiK3ForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
KimiK3ForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
KimiK3ForQuestionAnswering.register_for_auto_class("AutoModelForQuestionAnswering")


__all__ = [
    "KimiK3PreTrainedModel",
    "KimiK3Model",
    "KimiK3ForCausalLM",
    "KimiK3ForSequenceClassification",
    "KimiK3ForTokenClassification",
    "KimiK3ForQuestionAnswering",
]
