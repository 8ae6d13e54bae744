"""The fused SiTU-GLU kernels, attached from outside at the model's activation seam, equal the model's eager
`situ_and_mul` (alone and inside the MoE block, forward and backward), serve the routed experts through their
concatenated kernel and the dense GLUs through the separate one, stay out of inference and small activations, come off
with their handle, and fall back to the reference when compilation fails."""

import os
import subprocess
import sys

import pytest
import torch
from transformers.testing_utils import CaptureLogger

from kimi_k3.attachments.handle import attribute_owners
from kimi_k3.attachments.seams import find_situ_activations
from kimi_k3.kernels import compiled, fused_situ
from kimi_k3.kernels.compiled import CompiledFunction
from kimi_k3.kernels.fused_situ import (
    SHARED_KERNELS,
    TANH_SERIES_BELOW,
    SiTUKernels,
    fused_min_elements,
    fused_situ_and_mul,
    fused_situ_glu,
    kernel_tanh,
    situ_glu,
    tanh_from_exp,
    use_fused_situ,
)
from modeling_kimi_k3 import KimiK3GLUActivation, KimiK3SparseMoeBlock, situ_and_mul
from tests.conftest import HANG_CEILING_S, ROOT, CallCounter, tiny_config
from tests.numerics import assert_as_accurate


def situ_inputs(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[gate ‖ up] spanning the regions where the tanh caps bite (|g| ≫ β₁ = 4, |u| ≫ β₂ = 25)."""
    return (torch.randn(rows, 2 * width, dtype=torch.float64) * 20).to(dtype).requires_grad_()


def value_and_grad(function, gate_up: torch.Tensor, linear_beta: float | None, concatenated: bool):
    out = function(gate_up, 4.0, linear_beta) if concatenated else function(*gate_up.chunk(2, -1), 4.0, linear_beta)
    (grad,) = torch.autograd.grad(out, gate_up, torch.randn_like(out, generator=torch.Generator().manual_seed(1)))
    return out, grad


def tanh_arguments() -> torch.Tensor:
    """float32 values across tanh's range: both signs, 10⁻³⁰ to 100 on a log scale (the series, the crossover at 1/4
    and the exp form), normal draws, zeros, infinities and the smallest subnormal."""
    magnitudes = torch.logspace(-30, 2, 200_001, dtype=torch.float64)
    special = torch.tensor([0.0, -0.0, 0.25, -0.25, float("inf"), -float("inf"), 1e-45, -1e-45], dtype=torch.float64)
    normal = torch.randn(100_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    return torch.cat([magnitudes, -magnitudes, special, normal]).float()


def tanh_rounding_bound(x: torch.Tensor) -> torch.Tensor:
    """The relative error `tanh_from_exp` can make in float32, from its own operations (unit roundoff u = 2⁻²⁴):

    - the exp form: ``exp`` within 1 ulp (2u relative, SLEEF's and MKL's alike), carried into (1 - e)/(1 + e) by its
      condition in e, κ = 2e / ((1 - e)(1 + e)) (1.92 at |x| = 1/4, falling fast beyond), then one rounding each for
      1 - e, 1 + e and the division: (2κ + 3)u;
    - the series: the last Horner step 1 + x²·s and the product by x round once each, and every earlier rounding is
      scaled by x²/3 ≤ 1/48: 3u."""
    unit_roundoff = torch.finfo(torch.float32).eps / 2
    magnitude = x.double().abs()
    e = torch.exp(-2 * magnitude)
    condition = 2 * e / ((1 - e) * (1 + e))
    return torch.where(magnitude < TANH_SERIES_BELOW, 3.0, 2 * condition + 3) * unit_roundoff


def assert_tanh_within_its_rounding_bound(values: torch.Tensor, x: torch.Tensor) -> None:
    exact = torch.tanh(x.double())
    error = (values.double() - exact).abs()
    bound = tanh_rounding_bound(x) * exact.abs()
    worst = x[(error - bound).argmax()].item()
    assert bool((error <= bound).all()), f"worst x {worst!r}: error {error.max().item():.3g}"
    assert torch.equal(torch.signbit(values), torch.signbit(exact))  # odd, signed zeros included


def test_tanh_from_exp_is_within_its_rounding_bound_of_tanh_over_its_range():
    """The formula eager and as inductor compiles it (its own exp, its own order): within the relative error its own
    roundings allow (`tanh_rounding_bound`, under 3.5 float32 epsilons) everywhere, exact signs and zeros, ±1 at
    ±inf, NaN kept."""
    x = tanh_arguments()
    assert tanh_rounding_bound(x).max() < 3.5 * torch.finfo(torch.float32).eps  # the crossover keeps κ small
    compiled_formula = CompiledFunction(tanh_from_exp, static_widths=True)
    for values in (tanh_from_exp(x), compiled_formula(x)):
        assert_tanh_within_its_rounding_bound(values, x)
    assert not compiled_formula.failed
    assert tanh_from_exp(torch.tensor([float("nan")])).isnan().all()


def test_the_kernels_tanh_is_torchs_outside_compilation_and_the_formula_inside(monkeypatch):
    """Eager (a compiler failure, a dispatch mode, float64 references) the kernels keep torch.tanh, faster there and
    exact; compiled for a CPU they take `tanh_from_exp`, except in float64, where the series would not be exact
    enough; off the CPU (here the meta device) they keep torch.tanh."""
    x = tanh_arguments()
    assert torch.equal(kernel_tanh(x), torch.tanh(x))
    traced = []
    monkeypatch.setattr(fused_situ, "tanh_from_exp", lambda t: traced.append((t.dtype, t.device.type)) or torch.tanh(t))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    kernel_tanh(x), kernel_tanh(x.double()), kernel_tanh(x.to("meta"))
    assert traced == [(torch.float32, "cpu")]


def test_static_widths_compile_once_per_width_with_the_leading_dims_dynamic():
    """``static_widths=True``: rows of any count reuse one compilation per last-dim size, whose graph has that size as
    a constant and the row count symbolic (inductor's loops over a symbolic innermost size ran 1.3-1.5x slower)."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        placeholders = [node.meta["example_value"] for node in graph_module.graph.nodes if node.op == "placeholder"]
        graphs.append([tuple(value.shape) for value in placeholders if isinstance(value, torch.Tensor)])
        return graph_module.forward

    def scaled(x):  # a new code object: nothing cached to reuse
        return x * 2

    kernel = CompiledFunction(scaled, backend=recording_backend, static_widths=True)
    for shape in ((37, 24), (301, 24), (3, 5, 24), (7, 9, 24), (37, 40), (12, 40)):
        x = torch.randn(shape)
        torch.testing.assert_close(kernel(x), x * 2)
    assert len(graphs) == 3, graphs  # width 24 in 2-D, width 24 in 3-D, width 40
    for (shape,) in graphs:
        assert isinstance(shape[-1], int) and all(isinstance(size, torch.SymInt) for size in shape[:-1]), shape


@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("concatenated", [True, False])
def test_the_kernels_functions_equal_the_reference_and_autograd_through_it_fp64(linear_beta, concatenated):
    """What the kernels compile (here run eagerly: float64 has no vectorised CPU kernel to compare) ≡ `situ_and_mul`
    and autograd through it, in the layout of the input, at odd shapes."""
    gate_up = situ_inputs(53, 24, torch.float64)
    grad_output = torch.randn(53, 24, dtype=torch.float64)
    expected_out = situ_glu(gate_up, 4.0, linear_beta)
    (expected,) = torch.autograd.grad(expected_out, gate_up, grad_output)
    kernels = SiTUKernels()
    for kernel in kernels.all():
        kernel.failed = True
    fused = fused_situ_glu if concatenated else fused_situ_and_mul
    inputs = (gate_up,) if concatenated else gate_up.chunk(2, -1)
    out = fused(*inputs, 4.0, linear_beta, kernels)
    (grad,) = torch.autograd.grad(out, gate_up, grad_output)
    assert torch.equal(out, expected_out)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    assert all(kernel.compiled is None for kernel in kernels.all())


@pytest.mark.parametrize(
    ("dtype", "linear_beta", "concatenated"),
    [(torch.float64, 25.0, True), (torch.float32, None, False), (torch.bfloat16, 25.0, True),
     (torch.bfloat16, None, False), (torch.float32, 25.0, True)],
)
def test_fused_situ_equals_the_reference_forward_and_backward(dtype, linear_beta, concatenated):
    """Compiled SiTU-GLU ≡ eager `situ_and_mul`, values and input gradients, at two odd shapes (dynamic shapes):
    as close to the float64 reference as the eager one in the same precision is."""
    fused = fused_situ_glu if concatenated else fused_situ_and_mul
    reference = situ_glu if concatenated else situ_and_mul
    for rows, width in [(37, 24), (301, 40)]:
        gate_up = situ_inputs(rows, width, dtype)
        out, grad = value_and_grad(fused, gate_up, linear_beta, concatenated)
        expected_out, expected_grad = value_and_grad(reference, gate_up, linear_beta, concatenated)
        exact_out, exact_grad = value_and_grad(reference, gate_up.detach().double().requires_grad_(), linear_beta,
                                               concatenated)
        assert out.dtype == dtype and grad.shape == gate_up.shape
        assert_as_accurate(out, expected_out, exact_out, what="output")
        assert_as_accurate(grad, expected_grad, exact_grad, what="gradient")
    used = (("concatenated_output", "concatenated_gradient") if concatenated else ("output", "gradients"))
    assert all(getattr(SHARED_KERNELS, name).compiled is not None and not getattr(SHARED_KERNELS, name).failed
               for name in used)


def tiny_moe_block() -> KimiK3SparseMoeBlock:
    """A training-mode MoE block of the tiny config with N(0, 0.3) weights (a bare module's are uninitialised)."""
    torch.manual_seed(0)
    config = tiny_config()
    config._experts_implementation = "grouped_mm"  # what a model sets up; a bare block would run the eager loop
    block = KimiK3SparseMoeBlock(config).train()
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return block


def moe_block_outputs(fused: bool, hidden: torch.Tensor, dtype: torch.dtype = torch.float32):
    block = tiny_moe_block().to(dtype)
    if dtype == torch.float64:
        block.experts.config._experts_implementation = "eager"  # grouped_mm kernels have no fp64 path
    if fused:
        use_fused_situ(block, min_elements=64)
    hidden = hidden.clone().requires_grad_()
    out = block(hidden)
    out.backward(torch.ones_like(out))
    return out, hidden.grad, {name: p.grad for name, p in block.named_parameters() if p.grad is not None}


def test_moe_block_trains_through_the_fused_situ_and_matches_the_eager_block(monkeypatch):
    """Routed experts (concatenated gate/up) and shared experts (separate) both take the fused kernel."""
    concatenated = CallCounter(monkeypatch, fused_situ, "fused_situ_glu")
    separate = CallCounter(monkeypatch, fused_situ, "fused_situ_and_mul")
    hidden = torch.randn(2, 45, tiny_config().hidden_size)
    out, hidden_grad, grads = moe_block_outputs(True, hidden)
    assert concatenated.calls == 1 and separate.calls == 1
    assert not any(kernel.failed for kernel in SHARED_KERNELS.all())
    expected_out, expected_hidden_grad, expected_grads = moe_block_outputs(False, hidden)
    assert concatenated.calls == 1 and separate.calls == 1
    exact_out, exact_hidden_grad, exact_grads = moe_block_outputs(False, hidden.double(), torch.float64)
    assert_as_accurate(out, expected_out, exact_out, what="output")
    assert_as_accurate(hidden_grad, expected_hidden_grad, exact_hidden_grad, what="input gradient")
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert_as_accurate(grads[name], expected_grads[name], exact_grads[name], what=name)


def test_fused_situ_attaches_to_every_activation_and_its_handle_gives_back_the_reference():
    """The routed experts' and the shared experts' activation modules (the model's one seam) take the fused forward;
    a second attachment is refused, and removal leaves no instance attribute behind."""
    block = tiny_moe_block()
    activations = find_situ_activations(block)
    assert sorted(activations) == ["experts.glu", "shared_experts.glu"]
    attachment = use_fused_situ(block)
    assert all(attribute_owners(activation) == {"forward": "fused SiTU-GLU"} for activation in activations.values())
    with pytest.raises(ValueError, match=r"fused SiTU-GLU cannot set KimiK3GLUActivation.forward: fused SiTU-GLU holds"):
        use_fused_situ(block)
    attachment.remove()
    assert all("forward" not in vars(activation) and not attribute_owners(activation)
               for activation in activations.values())


def test_fused_situ_is_not_used_for_inference_small_activations_or_after_removal(monkeypatch):
    spies = (CallCounter(monkeypatch, fused_situ, "fused_situ_glu"),
             CallCounter(monkeypatch, fused_situ, "fused_situ_and_mul"))
    block = tiny_moe_block()
    with use_fused_situ(block):
        block(torch.randn(1, 9, tiny_config().hidden_size)).sum().backward()  # below fused_min_elements
    attachment = use_fused_situ(block, min_elements=1)
    with torch.no_grad():
        block(torch.randn(1, 9, tiny_config().hidden_size))
    assert [spy.calls for spy in spies] == [0, 0]
    attachment.remove()  # back to the model's own reference
    block(torch.randn(1, 9, tiny_config().hidden_size)).sum().backward()
    assert [spy.calls for spy in spies] == [0, 0]


def test_the_default_size_from_which_situ_runs_compiled_follows_the_cpus_vector_kernels(monkeypatch):
    """Where the compiled pair starts to beat eager SiTU-GLU depends on the vector width: 2¹⁷ outputs with AVX-512
    kernels, 2¹⁹ with AVX2 or narrower; off the CPU, any activation worth a launch."""
    for capability, expected in (("AVX512", 2**17), ("AVX2", 2**19), ("DEFAULT", 2**19)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert fused_min_elements("cpu") == expected
    assert fused_min_elements("cuda") == 2**17


def test_the_size_counts_outputs_in_both_layouts_and_one_row_less_runs_eagerly(monkeypatch):
    """Separate gate and up of n elements each, or the experts' [gate ‖ up] of 2n, both give n outputs."""
    for kernel in SHARED_KERNELS.all():  # which path runs is the point here, not compilation
        monkeypatch.setattr(kernel, "failed", True)
    spies = (CallCounter(monkeypatch, fused_situ, "fused_situ_and_mul"),
             CallCounter(monkeypatch, fused_situ, "fused_situ_glu"))
    activation = KimiK3GLUActivation(tiny_config())
    rows = fused_min_elements("cpu") // 64
    with use_fused_situ(activation):
        for height in (rows - 1, rows):
            activation(*(torch.zeros(height, 64, requires_grad=True) for _ in range(2)))
            activation(torch.zeros(height, 128, requires_grad=True))
    assert [spy.calls for spy in spies] == [1, 1]


def test_the_size_is_the_one_of_the_activations_own_device(monkeypatch):
    """An activation off the CPU (here on the meta device) fuses from its device's size, not from the CPU's (with
    AVX2 kernels, where the two differ)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    outputs = fused_min_elements("meta")
    assert outputs < fused_min_elements("cpu")
    on_meta, on_cpu = (torch.empty(outputs // 64, 64, device=device, requires_grad=True) for device in ("meta", "cpu"))
    assert fused_situ.fuses(on_meta, on_meta, None) and not fused_situ.fuses(on_cpu, on_cpu, None)


def missing_cxx_compiler():
    """Inductor pointed at a C++ compiler that does not exist. torch's own config patch, not monkeypatch: pytest 9.2's
    undo deletes attributes it did not find in the instance dict, which removes the config entry altogether."""
    return torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",)})


@missing_cxx_compiler()
def test_failed_compilation_falls_back_to_the_reference_with_one_warning():
    """A broken toolchain (here: inductor pointed at a C++ compiler that does not exist) costs speed, not results."""

    def situ_with_fresh_graph(gate, up, beta, linear_beta):  # a new code object: nothing cached to reuse
        return situ_and_mul(gate, up, beta, linear_beta)

    fused = CompiledFunction(situ_with_fresh_graph)
    gate_up = situ_inputs(16, 8, torch.float32)
    with CaptureLogger(compiled.logger) as captured:
        first, first_grad = value_and_grad(fused, gate_up, 25.0, concatenated=False)
        second, _ = value_and_grad(fused, gate_up, 25.0, concatenated=False)
    expected, expected_grad = value_and_grad(situ_and_mul, gate_up, 25.0, concatenated=False)
    assert fused.failed and captured.out.count("torch.compile of `situ_with_fresh_graph` failed") == 1
    assert torch.equal(first, expected) and torch.equal(second, expected) and torch.equal(first_grad, expected_grad)


ISA_CHECK = """
import torch
from kimi_k3.kernels.fused_situ import SHARED_KERNELS, situ_glu
gate_up = torch.randn(512, 128, generator=torch.Generator().manual_seed(0))
exact = situ_glu(gate_up.double(), 4.0, 25.0)
out = SHARED_KERNELS.concatenated_output(gate_up, 4.0, 25.0)
error = (out.double() - exact).abs().max().item()
reference_error = (situ_glu(gate_up, 4.0, 25.0).double() - exact).abs().max().item()
bound = 4 * reference_error + 8 * torch.finfo(torch.float32).eps * exact.abs().max().item()
assert not SHARED_KERNELS.concatenated_output.failed and error <= bound, (error, bound)
"""


def test_kernels_compiled_under_a_restricted_cpu_capability_do_not_leak_through_inductors_cache(tmp_path):
    """Emulating an AVX2 CPU (``ATEN_CPU_CAPABILITY=avx2``) and training normally on one machine share inductor's
    cache; its key omits the restriction, so without care the second process runs the first one's kernel: wrong
    values and out-of-bounds writes (seen with torch 2.13 on an AVX-512 CPU)."""
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
                   "OMP_NUM_THREADS": "2"}  # the wrong kernels showed in the multi-threaded loop
    environment.pop("ATEN_CPU_CAPABILITY", None)
    for restricted in ({"ATEN_CPU_CAPABILITY": "avx2"}, {}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        result = subprocess.run([sys.executable, "-c", ISA_CHECK], env={**environment, **restricted},
                                capture_output=True, text=True, timeout=HANG_CEILING_S)
        assert result.returncode == 0, (restricted, result.stderr[-2000:])
