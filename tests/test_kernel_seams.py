"""The kernel seams of the model file (transformers' `kimi_linear` names: RMSNorm, RMSNormGated, chunk_kda,
fused_recurrent_kda, causal_conv1d_fn) with stand-in kernel packages on a CPU.

fla's Triton kernels and causal-conv1d's CUDA kernel do not run on CPU tensors, so `tests/stand_ins` stands in for
both packages: their module paths and argument names, their contracts checked, float64 inside. transformers' seams
resolve their package when the model file is imported, so the fixture imports a fresh copy of the file with the
stand-ins on ``sys.path``, and a test lets CPU tensors reach one (`KERNEL_PACKAGE_DEVICE_TYPES`). Then the default
model runs through the packages' calls, forward and backward with packed rows, forward with a cache (prefill,
continuation, decoding), and must equal the torch path within the float64-derived tolerance of ``tests/numerics.py``.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from configuration_kimi_k3 import KimiK3Config
from modeling_kimi_k3 import CACHE_FIELD, KimiK3ForCausalLM
from tests.numerics import assert_as_accurate, float64_copy

ROOT = Path(__file__).resolve().parents[1]
STAND_INS = Path(__file__).resolve().parent / "stand_ins"


def fresh_model_module(name: str, monkeypatch):
    """The model file imported anew (its seams resolve their packages now), as a checkpoint folder's copy would be;
    in ``sys.modules`` for the test, where transformers looks a model class's module up."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "modeling_kimi_k3.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


STAND_IN_MODULES = {"fla": "fla.ops.kda", "causal_conv1d": "causal_conv1d"}


@pytest.fixture
def packages_installed(monkeypatch):
    """The model file imported with the stand-in fla and causal-conv1d installed; yields the module and each
    stand-in's call list. transformers >= 5.25 routes a seam's tensors by device too, from a list it reads when the
    seam is declared: CPU is added there, so that the model's own choice (`send_cpu_tensors_to`) decides, as it does
    under 5.23 and 5.24."""
    monkeypatch.syspath_prepend(str(STAND_INS))
    for name in [name for name in sys.modules if name.split(".")[0] in STAND_IN_MODULES]:
        monkeypatch.delitem(sys.modules, name)  # a real package already imported: set aside for the test
    hub_kernels = importlib.import_module("transformers.integrations.hub_kernels")
    for package in STAND_IN_MODULES if hasattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES") else ():
        devices = hub_kernels._PACKAGE_SUPPORTED_DEVICES.get(package, ())
        monkeypatch.setitem(hub_kernels._PACKAGE_SUPPORTED_DEVICES, package, (*devices, "cpu"))
    try:
        module = fresh_model_module("modeling_kimi_k3_with_packages", monkeypatch)
        calls = {}
        for package, module_name in STAND_IN_MODULES.items():
            stand_in = importlib.import_module(module_name)
            assert stand_in.__file__.startswith(str(STAND_INS)), stand_in.__file__
            stand_in.CALLS.clear()
            calls[package] = stand_in.CALLS
        yield module, calls
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] in STAND_IN_MODULES]:
            del sys.modules[name]


def send_cpu_tensors_to(package: str, module, monkeypatch) -> None:
    """The model sends CPU tensors to ``package``'s kernels (`package_kernel_runs`)."""
    monkeypatch.setitem(module.KERNEL_PACKAGE_DEVICE_TYPES, package, ("cpu",))


@pytest.fixture
def fla_on_cpu(packages_installed, monkeypatch):
    module, calls = packages_installed
    send_cpu_tensors_to("fla", module, monkeypatch)
    return module, calls["fla"]


def twin_models(module):
    """The default model on the torch path, the same weights through ``module``'s seams, and a float64 copy."""
    config = KimiK3Config()
    torch_path = KimiK3ForCausalLM(config)
    through_seams = module.KimiK3ForCausalLM(config)
    through_seams.load_state_dict(torch_path.state_dict())
    return config, torch_path, through_seams, float64_copy(torch_path)


def kda_layers(model) -> list:
    return [module for module in model.modules() if type(module).__name__ == "KimiK3DeltaAttention"]


def packed_batch(lengths_per_row: list[list[int]], vocab_size: int) -> dict:
    """Rows of packed documents, marked by restarting position ids (transformers' padding-free convention)."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])
    return {"input_ids": torch.randint(3, vocab_size, positions.shape), "position_ids": positions, "use_cache": False}


def forward_backward(model, batch: dict, probe: torch.Tensor):
    model.zero_grad()
    logits = model(**batch).logits
    (logits.double() * probe).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_model_results(through_seams, torch_path, exact, what: str) -> None:
    (logits, grads), (trusted, trusted_grads), (exact_logits, exact_grads) = through_seams, torch_path, exact
    assert_as_accurate(logits, trusted, exact_logits, what=f"{what} logits")
    assert grads.keys() == trusted_grads.keys()
    for name in grads:
        assert_as_accurate(grads[name], trusted_grads[name], exact_grads[name], what=f"{what} grad of {name}")


def test_packed_rows_run_fla_chunk_kda_with_cu_seqlens_and_k3_gate_forward_and_backward(fla_on_cpu):
    module, calls = fla_on_cpu
    config, torch_path, through_seams, exact = twin_models(module)
    batch = packed_batch([[5, 9, 3], [11, 6]], config.vocab_size)
    probe = torch.randn(2, 17, config.vocab_size, dtype=torch.float64)
    results = [forward_backward(model, batch, probe) for model in (through_seams, torch_path, exact)]
    assert_same_model_results(*results, what="packed rows")

    layers = kda_layers(torch_path)
    layer = layers[0]
    expected = {
        "kernel": "chunk_kda", "shape": (1, 34, layer.num_heads, layer.head_dim),
        "cu_seqlens": [0, 5, 14, 17, 28, 34], "scale": layer.head_dim**-0.5, "use_qk_l2norm_in_kernel": True,
        "safe_gate": True, "lower_bound": layer.gate_lower_bound, "initial_state": None, "output_final_state": False,
    }
    assert layer.gate_lower_bound == -5.0 and calls == [expected] * len(layers)


@torch.no_grad()
def run_with_cache(model, steps: list[dict]) -> torch.Tensor:
    """Prefill, a multi-token continuation and single-token decoding steps on one cache: every step's logits. (No
    backward: transformers' cache updates the recurrent state in place, which autograd refuses to differentiate.)"""
    cache, logits = None, []
    for step in steps:
        out = model(**step, cache=cache, use_cache=True)
        cache = getattr(out, CACHE_FIELD)
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def test_cached_prefill_continuation_and_decoding_run_fla_with_the_cached_state(fla_on_cpu):
    module, calls = fla_on_cpu
    config, torch_path, through_seams, exact = twin_models(module)
    ids = torch.randint(3, config.vocab_size, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :2] = 0  # left padding in the second row
    steps = [
        {"input_ids": ids[:, :6], "attention_mask": mask[:, :6]},
        {"input_ids": ids[:, 6:9], "attention_mask": mask[:, :9]},
        {"input_ids": ids[:, 9:10], "attention_mask": mask[:, :10]},
        {"input_ids": ids[:, 10:11], "attention_mask": mask[:, :11]},
    ]
    logits, trusted, exact_logits = (run_with_cache(model, steps) for model in (through_seams, torch_path, exact))
    assert_as_accurate(logits, trusted, exact_logits, what="cached steps' logits")

    layers = kda_layers(torch_path)
    layer = layers[0]
    state = (2, layer.num_heads, layer.head_dim, layer.head_dim)
    per_step = [("chunk_kda", 6, None), ("chunk_kda", 3, state), ("fused_recurrent_kda", 1, state),
                ("fused_recurrent_kda", 1, state)]
    assert [(c["kernel"], c["shape"][1], c["initial_state"]) for c in calls] == [
        step for step in per_step for _ in layers
    ]
    assert all(c["output_final_state"] and c["scale"] == layer.head_dim**-0.5 and c["cu_seqlens"] is None
               for c in calls)
    chunked = [c for c in calls if c["kernel"] == "chunk_kda"]
    assert all(c["safe_gate"] and c["lower_bound"] == layer.gate_lower_bound for c in chunked)


def test_cpu_tensors_stay_on_the_torch_bodies_while_the_packages_are_installed(packages_installed):
    """Before transformers 5.25 a seam hands any tensor to an installed package; the model keeps CPU tensors off."""
    module, calls = packages_installed
    assert module.INSTALLED_KERNEL_PACKAGES == {"fla", "causal_conv1d"}
    config, torch_path, through_seams, _ = twin_models(module)
    batch = packed_batch([[7, 4]], config.vocab_size)
    with torch.no_grad():
        assert torch.equal(through_seams(**batch).logits, torch_path(**batch).logits)
    assert calls == {"fla": [], "causal_conv1d": []}



def test_whole_rows_run_causal_conv1d_and_packed_rows_keep_their_taps_in_their_documents(packages_installed,
                                                                                       monkeypatch):
    module, calls = packages_installed
    send_cpu_tensors_to("causal_conv1d", module, monkeypatch)
    config, torch_path, through_seams, exact = twin_models(module)
    ids = torch.randint(3, config.vocab_size, (2, 9))
    steps = [{"input_ids": ids[:, :6]}, {"input_ids": ids[:, 6:8]}, {"input_ids": ids[:, 8:9]}]
    logits, trusted, exact_logits = (run_with_cache(model, steps) for model in (through_seams, torch_path, exact))
    assert_as_accurate(logits, trusted, exact_logits, what="cached steps' logits")
    layer = kda_layers(torch_path)[0]
    channels, context = layer.num_heads * layer.head_dim, layer.conv_kernel_size
    # The prefill convolves its tokens, every later step the cached window (transformers' cache keeps kernel-size
    # inputs) and its own: q, k and v in every layer.
    widths = (6, context + 2, context + 1)
    per_step = [(2, channels, width) for width in widths for _ in range(3 * len(kda_layers(torch_path)))]
    assert [c["shape"] for c in calls["causal_conv1d"]] == per_step
    assert all(c["activation"] == "silu" and c["width"] == layer.conv_kernel_size and not c["bias"]
               for c in calls["causal_conv1d"])

    calls["causal_conv1d"].clear()
    batch = packed_batch([[5, 9, 3], [11, 6]], config.vocab_size)
    with torch.no_grad():
        packed, trusted, exact_packed = (model(**batch).logits for model in (through_seams, torch_path, exact))
    assert_as_accurate(packed, trusted, exact_packed, what="packed rows' logits")
    assert calls["causal_conv1d"] == []  # causal-conv1d's seq_idx is not used: the torch body keeps the taps apart
