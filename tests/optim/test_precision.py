"""Precision by hardware: bf16 Newton–Schulz only where bf16 matmuls are native, fp32 otherwise, either on request."""

import pytest
import torch

from kimi_k3.job import main as train
from kimi_k3.optim import precision
from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.optim.newton_schulz import zeropower_via_newton_schulz5
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config
from tests.numerics import BF16_EPS, FP32_EPS


def pretend_cpu(monkeypatch, capability: str, avx512_bf16: bool, amx: bool = False) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize(
    "capability, avx512_bf16, amx, expected",
    [
        ("AVX2", False, False, torch.float32),  # the AVX2-only EPYC: emulated bf16
        ("AVX2", True, False, torch.float32),  # ATEN_CPU_CAPABILITY=avx2 on a bf16 CPU: treated as AVX2
        ("AVX512", False, False, torch.float32),  # AVX-512 without its bf16 extension
        ("AVX512", True, False, torch.bfloat16),
        ("AVX512", False, True, torch.bfloat16),  # AMX
    ],
)
def test_auto_precision_is_bf16_only_on_cpus_with_native_bf16(monkeypatch, capability, avx512_bf16, amx, expected):
    pretend_cpu(monkeypatch, capability, avx512_bf16, amx)
    assert precision.matmul_dtype("auto", "cpu") is expected
    assert precision.matmul_dtype("float32", "cpu") is torch.float32
    assert precision.matmul_dtype(torch.bfloat16, "cpu") is torch.bfloat16


def test_muon_resolves_its_newton_schulz_dtype_from_the_parameters_device(monkeypatch):
    weight = torch.nn.Parameter(torch.zeros(8, 8))
    pretend_cpu(monkeypatch, "AVX2", avx512_bf16=False)
    assert PerHeadMuon([weight]).ns_dtype is torch.float32
    assert PerHeadMuon([weight], ns_dtype="bfloat16").ns_dtype is torch.bfloat16
    pretend_cpu(monkeypatch, "AVX512", avx512_bf16=True)
    assert PerHeadMuon([weight]).ns_dtype is torch.bfloat16


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match=r"one of \('auto', 'bfloat16', 'float32'\).*'float16'"):
        PerHeadMuon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype="float16")


def test_fp32_newton_schulz_is_near_orthogonal_and_matches_bf16_within_bf16_tolerance():
    torch.manual_seed(0)
    blocks = torch.randn(64, 24, 40, dtype=torch.float64)
    exact = zeropower_via_newton_schulz5(blocks, dtype=torch.float64)
    fp32 = zeropower_via_newton_schulz5(blocks, dtype=torch.float32)
    bf16 = zeropower_via_newton_schulz5(blocks, dtype=torch.bfloat16)
    assert (fp32.double() - exact).abs().max() < 64 * FP32_EPS  # the fp64 recursion itself, at fp32 rounding
    relative = (bf16.double() - exact).norm() / exact.norm()
    assert relative < 4 * BF16_EPS  # bf16 rounding of 15 products (measured 6e-3)
    singular_values = torch.linalg.svdvals(fp32)
    assert singular_values.min() >= 0.6 and singular_values.max() <= 1.25


def test_forced_bf16_and_fp32_muon_steps_agree_within_bf16_tolerance():
    """One Per-Head Muon step on the tiny K3 model with each Newton–Schulz precision, from the same gradients.

    Gaussian gradients are full rank: NS5 maps singular values far below the largest one through a steep
    polynomial, so on the near-rank-deficient gradients of a 32-token batch those directions differ by more than
    bf16 rounding in either precision.
    """
    config = tiny_config()
    torch.manual_seed(0)
    start = KimiK3ForCausalLM(config)
    updates = {}
    for dtype in ("float32", "bfloat16"):
        model = KimiK3ForCausalLM(config)
        model.load_state_dict(start.state_dict())
        optimizer = PerHeadMuon.for_model(model, lr=1e-2, ns_dtype=dtype)
        generator = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        updates[dtype] = {name: p.detach() - start.state_dict()[name] for name, p in model.named_parameters()}
    muon_names = [name for group in optimizer.param_groups if group["use_muon"] for name, p in model.named_parameters()
                  if any(p is q for q in group["params"])]
    assert len(muon_names) > 40
    errors = {name: (updates["bfloat16"][name] - updates["float32"][name]).norm() / updates["float32"][name].norm()
              for name in muon_names}
    assert max(errors.values()) < 4 * BF16_EPS  # bf16 rounding through NS5's 15 products (measured 1.2-2.2e-2)
    assert not any(torch.equal(updates["bfloat16"][name], updates["float32"][name]) for name in muon_names)


def test_bf16_autocast_on_a_cpu_without_native_bf16_warns_once(monkeypatch, caplog, tmp_path):
    pretend_cpu(monkeypatch, "AVX2", avx512_bf16=False)
    status = train.main(["--output_dir", str(tmp_path / "out"), "--bf16", "True", "--use_cpu", "True",
                         "--data_files", str(tmp_path / "missing.txt")])
    assert status == 2  # stops at the missing file, after the warning
    warnings = [record.message for record in caplog.records if "without native bf16" in record.message]
    assert len(warnings) == 1 and "Drop --bf16" in warnings[0]
    pretend_cpu(monkeypatch, "AVX512", avx512_bf16=True)
    assert not precision.warn_if_bf16_is_emulated(True, "cpu")


def test_the_job_autocasts_to_bf16_by_default_only_on_an_accelerator_with_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    assert not precision.accelerator_has_native_bf16()  # a CPU-only machine: fp32 unless --bf16 True
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device("cuda"))
    for native in (True, False):  # Ampere on; Volta and Turing emulate bf16
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, native=native: native)
        assert precision.accelerator_has_native_bf16() is native
