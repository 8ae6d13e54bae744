"""Tolerances derived from the computation, not tuned on one CPU.

Two evaluations of one computation in another order (sharded sums, fused kernels, another ISA's vector width) round
differently, by an amount set by the computation's condition (cancellation in a sum of many terms) and by the CPU's
kernels. Float64 evaluations measure it: a result is acceptable when it is no further from the float64 result than
the error scale of the working precision, taken as the larger of

- the distance of a trusted evaluation in the working precision (one process, the reference kernel), and
- the spread of float64 evaluations whose inputs were perturbed by one rounding of the working precision: a sum
  with cancellation amplifies that perturbation as it amplifies rounding, where one trusted evaluation may happen
  to round luckily;

times a small factor. Comparisons of two float64 evaluations keep fixed bounds (1e-9 and tighter): float64 rounding is
1e-16 relative, so such a bound holds on any CPU unless the computation itself is wrong.
"""

import copy

import torch
from torch import nn

# Both evaluations round the same terms in another order, so their errors have the same size; 4x covers the spread
# of that size over orders (the largest seen over avx2, avx512 and unvectorised kernels: 2x).
ROUNDING_FACTOR = 4.0
# A few units in the last place of the result's scale, for results that every evaluation happens to round exactly.
ULPS = 8


@torch.no_grad()
def perturb_parameters(model: nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``model`` with every parameter multiplied by ``1 + ε·N(0, 1)``, ``ε`` the unit roundoff of ``dtype``."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    eps = torch.finfo(dtype).eps
    for parameter in model.parameters():
        noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64).to(parameter.dtype)
        parameter.mul_(1 + eps * noise)
    return model


def error_scale(trusted: torch.Tensor, exact: torch.Tensor, perturbed: list[torch.Tensor] = ()) -> float:
    """The working precision's error on this result: the larger of the trusted evaluation's distance from ``exact``
    and the spread of the ``perturbed`` float64 evaluations around it."""
    if not exact.numel():
        return 0.0
    exact = exact.double()
    return max((other.double() - exact).abs().max().item() for other in (trusted, *perturbed))


def assert_as_accurate(actual: torch.Tensor, trusted: torch.Tensor, exact: torch.Tensor,
                       perturbed: list[torch.Tensor] = (), what: str = "", factor: float = ROUNDING_FACTOR) -> None:
    """``actual`` is within ``factor`` times the working precision's error scale (`error_scale`) of ``exact``."""
    assert actual.shape == exact.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(exact.shape)}"
    if not exact.numel():
        return
    distance = (actual.double() - exact.double()).abs().max().item()
    ulps = ULPS * torch.finfo(trusted.dtype).eps * exact.double().abs().max().item()
    bound = factor * error_scale(trusted, exact, perturbed) + ulps
    assert distance <= bound, (
        f"{what}: {distance:.3g} from the float64 result, more than {factor:g}x the working precision's error scale "
        f"plus {ULPS} ulps ({bound:.3g})"
    )


def assert_within_rounding_spread(actual: torch.Tensor, reference: torch.Tensor, perturbed: torch.Tensor,
                                  what: str = "", factor: float = ROUNDING_FACTOR) -> None:
    """``actual`` (the computation in another summation order) is within ``factor`` times the distance of
    ``perturbed`` (the computation from inputs perturbed by one rounding, `perturb_parameters`) from ``reference``,
    plus a few ulps of its scale.

    For results that float64 cannot reproduce cheaply (several training steps, whose later losses a rounding-level
    difference moves by what bf16 Newton–Schulz and the routing decisions make of it): the perturbed run measures, in
    the same run on the same CPU, how far rounding-level noise carries through this computation.
    """
    actual, reference, perturbed = (torch.as_tensor(t, dtype=torch.float64) for t in (actual, reference, perturbed))
    distance = (actual - reference).abs().max().item()
    spread = (perturbed - reference).abs().max().item()
    bound = factor * spread + ULPS * FP32_EPS * reference.abs().max().item()
    assert distance <= bound, (
        f"{what}: {distance:.3g} from the reference, more than {factor:g}x the distance a one-rounding perturbation "
        f"of the inputs moves it ({spread:.3g}) plus {ULPS} ulps ({bound:.3g})"
    )


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of a model, on the experts' reference loop (transformers' grouped_mm kernels have no fp64 path)."""
    exact = copy.deepcopy(model).double()
    if hasattr(exact, "set_experts_implementation"):
        exact.set_experts_implementation("eager")
    return exact


# Unit roundoffs for bounds set by a precision and a count of roundings (Newton–Schulz in bf16, say).
FP32_EPS = torch.finfo(torch.float32).eps
BF16_EPS = torch.finfo(torch.bfloat16).eps
