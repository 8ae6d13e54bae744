"""MXFP4 packing of routed-expert weights for the released checkpoint layout (architecture.md §3.3).

Format (OCP microscaling, compressed-tensors ``mxfp4-pack-quantized``): groups of 32 consecutive input features
share one E8M0 scale 2^(s − 127); each element is an E2M1 code (bit 3 = sign, bits 0-2 index
{0, 0.5, 1, 1.5, 2, 3, 4, 6}); two codes per byte, element 2j in the low nibble.

Scale rule: each group takes the *smallest* power of two X with max|w| <= 6·X, so the group maximum always fits
the grid without clipping. Elements are then rounded to the nearest E2M1 value of w / X, ties to the even code.
Because X is the smallest fitting scale, a group that is representable at any scale is reproduced exactly
(pack∘unpack is the identity on representable weights). The MX specification's rule
X = 2^(floor(log2 max|w|) − 2) instead saturates group maxima in (6X, 8X) to 6X.
The scale is clamped at the smallest E8M0 value 2^-127 (s = 0): an all-zero group gets it, and a group whose
maximum is below 6·2^-127 rounds onto that finest grid.

Decoding lives in the model file (`modeling_kimi_k3.dequantize_mxfp4`) because checkpoints ship that file alone.
"""

import torch

from modeling_kimi_k3 import E2M1_MAGNITUDES, MXFP4_GROUP_SIZE, dequantize_mxfp4

__all__ = ["quantize_mxfp4", "dequantize_mxfp4", "MXFP4_GROUP_SIZE"]

_E2M1_MAX = E2M1_MAGNITUDES[-1]


def quantize_mxfp4(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., n] -> (blocks uint8 [..., n/2], scales uint8 [..., n/32]); ``name`` labels errors."""
    if weight.ndim == 0 or weight.shape[-1] % MXFP4_GROUP_SIZE:
        raise ValueError(
            f"`{name}` has shape {list(weight.shape)}: MXFP4 groups {MXFP4_GROUP_SIZE} input features, so its last "
            f"dimension must be a multiple of {MXFP4_GROUP_SIZE}."
        )
    groups = weight.float().unflatten(-1, (-1, MXFP4_GROUP_SIZE))
    group_max = groups.abs().amax(-1)  # NaN and inf propagate into the group maximum
    if not torch.isfinite(group_max).all():
        raise ValueError(f"`{name}` holds non-finite values, which MXFP4 cannot encode.")
    scale_exponents = _smallest_fitting_exponents(group_max)
    scaled = groups / _power_of_two(scale_exponents - 127)[..., None]
    codes = _e2m1_codes(scaled).flatten(-2)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, scale_exponents.to(torch.uint8)


def _smallest_fitting_exponents(group_max: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents s (int32) of the smallest 2^(s − 127) with group_max <= 6 · 2^(s − 127), s >= 0."""
    mantissa, exponent = torch.frexp(group_max.clamp_min(torch.finfo(torch.float32).tiny) / _E2M1_MAX)
    # frexp gives m·2^e with m in [0.5, 1): ceil(log2) is e, or e − 1 when m is exactly 0.5.
    unbiased = exponent - (mantissa == 0.5).int()
    # The division by 6 rounds; one exact comparison repairs a ceiling that came out one too small.
    unbiased += (group_max > _E2M1_MAX * _power_of_two(unbiased)).int()
    return (unbiased + 127).clamp_min(0)


def _power_of_two(exponents: torch.Tensor) -> torch.Tensor:
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
