"""Kimi K3 checkpoint formats: the expert layout, the MXFP4 codec, and the released checkpoint layout.

Shipped beside ``modeling_kimi_k3.py`` (``save_pretrained`` copies relatively imported files into the folder), so a
released-layout folder loads with ``trust_remote_code`` alone. It imports only torch, safetensors and transformers.

- **Expert layout**: on disk every routed expert is three matrices ``experts.{e}.w1/w2/w3.weight`` (the released
  names); in memory the experts are fused 3-D tensors for transformers' experts backends. `EXPERT_LAYOUT` declares
  the correspondence once; the conversion mapping, the state-dict hook, the shape checks and Per-Head Muon's
  per-expert blocks are derived from it.
- **MXFP4** (OCP Microscaling Formats v1.0, compressed-tensors ``mxfp4-pack-quantized``): groups of 32 input features
  share one E8M0 scale 2^(s − 127); each element is an E2M1 code (bit 3 = sign, bits 0-2 index
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}); two codes per byte, element 2j in the low nibble.
- **Released layout** (the Kimi-K3 checkpoint on the Hugging Face Hub): a multimodal wrapper ``config.json`` whose
  text part is ``text_config``, text tensors under ``language_model.``, routed experts as MXFP4 ``weight_packed`` /
  ``weight_scale`` pairs, KDA ``A_log`` zero-padded to head_dim. Loading checks every tensor first
  (`match_checkpoint_tensors` in ``loading_kimi_k3.py``), then reads through load-only transforms
  (`released_layout_transforms`); writing that layout is the training package's (``kimi_k3.checkpoint.release_format``).
"""

import re

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, PrefixChange, WeightConverter


# ---------------------------------------------------------------------------------------------------------------------
# Expert layout
# ---------------------------------------------------------------------------------------------------------------------
EXPERT_LAYOUT = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
"""Fused expert tensor [E, rows, cols] -> the per-expert matrices stacked along its rows, in order:
``gate_up_proj[e] = [w1; w3]`` (gate over up), ``down_proj[e] = w2``."""
ROUTED_EXPERT_WEIGHT = re.compile(
    rf"\.experts\.\d+\.({'|'.join(part for parts in EXPERT_LAYOUT.values() for part in parts)})\.weight$"
)


def expert_block_rows(fused_name: str, fused_shape: tuple[int, ...]) -> int:
    """Rows of one per-expert matrix inside the fused tensor ``fused_name`` (all of its parts have the same size)."""
    return fused_shape[1] // len(EXPERT_LAYOUT[fused_name])


def per_expert_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes that store the model tensor ``name``: one per expert and part for fused experts."""
    if not _is_fused_expert(name):
        return {name: shape}
    stem, _, leaf = name.rpartition(".")
    num_experts, _, columns = shape
    rows = expert_block_rows(leaf, shape)
    return {f"{stem}.{e}.{part}.weight": (rows, columns) for e in range(num_experts) for part in EXPERT_LAYOUT[leaf]}


def check_name_count(shapes: dict[str, tuple[int, ...]], stored_count: int) -> None:
    """Refuse, before building them, more per-expert checkpoint names than a checkpoint of ``stored_count`` tensors
    can match: a valid one stores every per-expert name, so an absurd ``num_experts`` stops here instead of slowly
    exhausting memory on names that cannot match."""
    count = sum(len(EXPERT_LAYOUT[name.rpartition(".")[2]]) * shape[0] if _is_fused_expert(name) else 1
                for name, shape in shapes.items())
    if count > stored_count + len(shapes):
        raise ValueError(
            f"Refusing the config: num_experts gives {count:,} per-expert checkpoint names where the checkpoint holds "
            f"{stored_count:,} tensors; check num_experts in config.json"
        )


def _is_fused_expert(name: str) -> bool:
    stem, _, leaf = name.rpartition(".")
    return stem.endswith(".experts") and leaf in EXPERT_LAYOUT


def fuse_per_expert_weights(state_dict: dict, prefix: str, num_experts: int) -> str | None:
    """Replace the per-expert keys under ``prefix`` by the fused tensors, in place, when all of them are present.

    Returns an error message when only some are (a shard boundary inside a layer): never a silent partial load.
    """
    names = {
        fused: [[f"{prefix}{e}.{part}.weight" for part in parts] for e in range(num_experts)]
        for fused, parts in EXPERT_LAYOUT.items()
    }
    flat = [name for per_expert in names.values() for parts in per_expert for name in parts]
    missing = [name for name in flat if name not in state_dict]
    if len(missing) == len(flat):
        return None
    if missing:
        return (
            f"{prefix[:-1]}: the state dict holds only some per-expert weights (missing e.g. {missing[0]}); "
            "load the whole checkpoint at once, e.g. with `from_pretrained`."
        )
    for fused, per_expert in names.items():
        state_dict[prefix + fused] = torch.stack([torch.cat([state_dict.pop(n) for n in parts]) for parts in per_expert])
    return None


def expert_layout_converters(stored_suffixes: tuple[str, ...] = ("weight",), dequantize: bool = False):
    """transformers ``WeightConverter``s between the per-expert checkpoint names and the fused tensors.

    ``stored_suffixes=("weight_packed", "weight_scale"), dequantize=True`` reads the released MXFP4 experts.
    """
    converters = []
    for fused, parts in EXPERT_LAYOUT.items():
        operations = [DequantizeMXFP4()] if dequantize else []
        operations.append(MergeModulelist(dim=0))
        if len(parts) > 1:
            operations.append(Concatenate(dim=1))
        converters.append(
            WeightConverter(
                source_patterns=[
                    rf"block_sparse_moe\.experts.*.{part}.{suffix}" for part in parts for suffix in stored_suffixes
                ],
                target_patterns=f"block_sparse_moe.experts.{fused}",
                operations=operations,
            )
        )
    return converters


def register_expert_layout(*class_names: str) -> None:
    """``save_pretrained`` writes, and ``from_pretrained`` reads, per-expert names for these model classes.

    Registered under our own class names (never a native model type); ``overwrite`` because the model file can be
    executed twice in one process (installed module and a ``transformers_modules`` copy).
    """
    for class_name in class_names:
        register_checkpoint_conversion_mapping(class_name, expert_layout_converters(), overwrite=True)


# ---------------------------------------------------------------------------------------------------------------------
# MXFP4 codec
# ---------------------------------------------------------------------------------------------------------------------
MXFP4_GROUP_SIZE = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _mxfp4_byte_values() -> torch.Tensor:
    """[256, 2]: the two values a byte encodes, element 2j in the low nibble; code bit 3 is the sign."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    codes = torch.cat([magnitudes, -magnitudes])
    byte = torch.arange(256)
    return torch.stack([codes[byte & 0xF], codes[byte >> 4]], dim=-1)


_MXFP4_BYTE_VALUES = _mxfp4_byte_values()
# E8M0: 2^(s − 127), exact in fp32 down to the subnormal 2^-127; s = 255 encodes NaN.
_E8M0_VALUES = torch.tensor([2.0 ** (s - 127) for s in range(255)] + [float("nan")])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 -> dense: W[n, 32g + r] = E2M1(code) · 2^(s[n, g] − 127), exact in bf16.

    ``blocks`` uint8 [..., in/2] holds two codes per byte; ``scales`` uint8 [..., in/32] one E8M0 exponent per group.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 `blocks` and `scales` must be uint8, got {blocks.dtype} and {scales.dtype}.")
    if blocks.shape[:-1] != scales.shape[:-1] or 2 * blocks.shape[-1] != MXFP4_GROUP_SIZE * scales.shape[-1]:
        raise ValueError(
            f"MXFP4 `blocks` {list(blocks.shape)} and `scales` {list(scales.shape)} disagree: for n input features "
            f"they must be [..., n/2] and [..., n/{MXFP4_GROUP_SIZE}]."
        )
    values = _MXFP4_BYTE_VALUES.to(blocks.device).index_select(0, blocks.flatten().long())
    group_scales = _E8M0_VALUES.to(blocks.device).index_select(0, scales.flatten().long())
    dense = values.view(-1, MXFP4_GROUP_SIZE) * group_scales[:, None]
    return dense.view(*blocks.shape[:-1], -1).to(dtype)


def quantize_mxfp4(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., n] -> (blocks uint8 [..., n/2], scales uint8 [..., n/32]); ``name`` labels errors.

    Each group takes the *smallest* power of two X with max|w| <= 6·X, so the group maximum always fits the grid
    without clipping; elements round to the nearest E2M1 value of w / X, ties to the even code. A group that is
    representable at any scale is therefore reproduced exactly (pack∘unpack is the identity on representable
    weights); the OCP rule X = 2^(floor(log2 max|w|) − 2) instead saturates group maxima in (6X, 8X) to 6X. The scale
    is clamped at the smallest E8M0 value 2^-127: an all-zero group gets it, and a group whose maximum is below
    6·2^-127 rounds onto that finest grid.
    """
    if weight.ndim == 0 or weight.shape[-1] % MXFP4_GROUP_SIZE:
        raise ValueError(
            f"`{name}` has shape {list(weight.shape)}: MXFP4 groups {MXFP4_GROUP_SIZE} input features, so its last "
            f"dimension must be a multiple of {MXFP4_GROUP_SIZE}."
        )
    groups = weight.float().unflatten(-1, (-1, MXFP4_GROUP_SIZE))
    group_max = groups.abs().amax(-1)  # NaN and inf propagate into the group maximum
    if not torch.isfinite(group_max).all():
        raise ValueError(f"`{name}` holds non-finite values, which MXFP4 cannot encode.")
    scale_exponents = smallest_fitting_exponents(group_max)
    scaled = groups / power_of_two(scale_exponents - 127)[..., None]
    codes = _e2m1_codes(scaled).flatten(-2)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, scale_exponents.to(torch.uint8)


def smallest_fitting_exponents(group_max: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents s (int32) of the smallest 2^(s − 127) with group_max <= 6 · 2^(s − 127), s >= 0."""
    e2m1_max = E2M1_MAGNITUDES[-1]
    mantissa, exponent = torch.frexp(group_max.clamp_min(torch.finfo(torch.float32).tiny) / e2m1_max)
    # frexp gives m·2^e with m in [0.5, 1): ceil(log2) is e, or e − 1 when m is exactly 0.5.
    unbiased = exponent - (mantissa == 0.5).int()
    # The division by 6 rounds; one exact comparison repairs a ceiling that came out one too small.
    unbiased += (group_max > e2m1_max * power_of_two(unbiased)).int()
    return (unbiased + 127).clamp_min(0)


def power_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """2^e in fp32, exact for every e the E8M0 range needs (down to the subnormal 2^-127)."""
    return torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8) of each |x| <= 6, ties to the even code.

    The grid steps by 0.5, 1 and 2 on the binades [0, 2), [2, 4) and [4, 6], where the codes start at 0, 4 and 6:
    code = round(|x| / step) + 2·[|x| >= 2] + 2·[|x| >= 4]. Dividing by a power of two is exact, and torch.round
    breaks ties to even, which here is the even code.
    """
    magnitude = scaled.abs()
    at_least_2, at_least_4 = magnitude >= 2, magnitude >= 4
    step = torch.full_like(magnitude, 0.5).masked_fill_(at_least_2, 1.0).masked_fill_(at_least_4, 2.0)
    codes = torch.round(magnitude.div_(step)).to(torch.uint8)
    codes += 2 * at_least_2.to(torch.uint8) + 2 * at_least_4.to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    return codes


class DequantizeMXFP4(ConversionOps):
    """(weight_packed, weight_scale) source pairs -> dense expert weights, stacked over experts.

    transformers materializes every checkpoint tensor in the target parameter's dtype before the ops run; the uint8
    codes and exponents (integers below 256) survive that cast exactly and are cast back here.
    """

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        dense = {}
        for packed_pattern, scale_pattern in zip(source_patterns[::2], source_patterns[1::2]):
            blocks, scales = input_dict.pop(packed_pattern), input_dict.pop(scale_pattern)
            first = blocks[0]
            stacked = first.new_empty((len(blocks), first.shape[0], 2 * first.shape[1]))
            for expert, (codes, exponents) in enumerate(zip(blocks, scales)):
                stacked[expert] = dequantize_mxfp4(codes.to(torch.uint8), exponents.to(torch.uint8), stacked.dtype)
            dense[packed_pattern] = stacked
        return dense


# ---------------------------------------------------------------------------------------------------------------------
# Released layout
# ---------------------------------------------------------------------------------------------------------------------
RELEASE_TEXT_PREFIX = "language_model."
RELEASE_MULTIMODAL_PREFIXES = ("vision_tower.", "mm_projector.")


class NarrowToHeads(ConversionOps):
    """The released ``A_log`` is zero-padded to head_dim; the model keeps its [num_heads] head.

    `match_checkpoint_tensors` has verified that the padded tail is zero.
    """

    def convert(self, input_dict, source_patterns, target_patterns, config=None, **kwargs):
        (tensors,) = input_dict.values()
        return {target_patterns[0]: tensors[0][: config.linear_num_heads].clone()}


def released_layout_transforms() -> list[WeightConverter | PrefixChange]:
    """Load-only transforms from the released layout onto the model's parameters."""
    return [
        PrefixChange(prefix_to_remove=RELEASE_TEXT_PREFIX.removesuffix(".")),
        *expert_layout_converters(stored_suffixes=("weight_packed", "weight_scale"), dequantize=True),
        WeightConverter(
            source_patterns=r"self_attn\.A_log", target_patterns="self_attn.A_log", operations=[NarrowToHeads()]
        ),
    ]


def released_tensor_shapes(name: str, shape: tuple[int, ...], config) -> dict[str, tuple[int, ...]]:
    """The released tensors (name -> shape) that store our checkpoint tensor ``name``."""
    key = RELEASE_TEXT_PREFIX + name
    if ROUTED_EXPERT_WEIGHT.search(name):
        rows, columns = shape
        if columns % MXFP4_GROUP_SIZE:
            raise ValueError(
                f"{name} has {columns} input features; MXFP4 groups need a multiple of {MXFP4_GROUP_SIZE} "
                "(routed_expert_hidden_size for w1/w3, moe_intermediate_size for w2)."
            )
        return {f"{key}_packed": (rows, columns // 2), f"{key}_scale": (rows, columns // MXFP4_GROUP_SIZE)}
    if name.endswith(".A_log"):
        return {key: (max(shape[0], config.linear_head_dim),)}  # zero-padded, never truncated
    return {key: shape}


def is_released_layout(names) -> bool:
    """The release prefixes text tensors with `language_model.` and stores routed experts as MXFP4 `weight_packed`."""
    return any(name.startswith(RELEASE_TEXT_PREFIX) or name.endswith(".weight_packed") for name in names)


def checkpoint_shapes(model, stored_names=()) -> dict[str, tuple[int, ...]]:
    """Names and shapes of our checkpoint layout for ``model``: per-expert w1/w3/w2 (fused expert tensors that
    ``stored_names`` holds, as ``save_pretrained(save_original_format=False)`` writes them, keep their fused name),
    spelt as the checkpoint spells them.

    transformers bridges base and task checkpoints through ``base_model_prefix``: a task model's folder stores
    ``model.*`` beside its head, a base model's folder stores the same tensors without the prefix. Without
    ``stored_names`` the names carry the prefix (the released layout's text tensors do); a task model reading a base
    folder still expects its head (reported missing), a base model reading a task folder expects no head
    (`base_model_entries` drops it).
    """
    base_prefix = f"{model.base_model_prefix}."
    text_names = [name.removeprefix(RELEASE_TEXT_PREFIX) for name in stored_names]
    stored_prefixed = not text_names or any(name.startswith(base_prefix) for name in text_names)
    is_base_model = model.base_model is model
    tied = set(getattr(model, "all_tied_weights_keys", {}))  # stored once, as the tensor they are tied to
    state = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if stored_names:
        check_name_count(state, len(stored_names))
    shapes = {}
    for name, shape in state.items():
        if name in tied:
            continue
        if is_base_model and stored_prefixed:
            name = base_prefix + name
        elif not is_base_model and not stored_prefixed:
            name = name.removeprefix(base_prefix)
        shapes.update({name: shape} if name in stored_names else per_expert_shapes(name, shape))
    return shapes
