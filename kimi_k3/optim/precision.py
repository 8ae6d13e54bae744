"""Precision the project picks by itself: bf16 only where the device multiplies bf16 matrices natively.

On a CPU without AVX-512-BF16 or AMX, a bf16 matmul is emulated and runs more than an order of magnitude slower than
fp32 (benchmarks/records/2026-12-05_figures_from_module_docstrings_various.md), so bf16 there buys nothing and costs
hours. CUDA GPUs from Ampere on and CPUs with AVX-512-BF16 or AMX run bf16 at least as fast as
fp32.
"""

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

PRECISION_CHOICES = ("auto", "bfloat16", "float32")


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX-512-BF16 or AMX) and ATen dispatches AVX-512 kernels.

    ``ATEN_CPU_CAPABILITY=avx2`` (with ``ONEDNN_MAX_CPU_ISA=AVX2``) makes such a CPU behave, and be treated, like an
    AVX2-only one. The instruction-set queries are torch's underscored ``torch.cpu`` helpers; a torch without them
    counts as "no native bf16", the safe side.
    """
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    probes = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(probe() for probe in probes if probe is not None)


def has_fast_bf16_matmul(device: torch.device | str) -> bool:
    """Whether bf16 matrix products on ``device`` are native (and so at least as fast as fp32)."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_has_native_bf16()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return True  # other accelerators (XPU, HPU, ...) have bf16 matrix units


def accelerator_has_native_bf16() -> bool:
    """Whether this machine has an accelerator (where ``Trainer`` trains without ``--use_cpu``) that multiplies bf16
    natively: the job's bf16 autocast default."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator is not None and has_fast_bf16_matmul(accelerator)


def matmul_dtype(choice: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype for project-chosen low-precision matmuls: ``"auto"`` is bf16 where native, else fp32."""
    if isinstance(choice, torch.dtype):
        choice = str(choice).removeprefix("torch.")
    if choice not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES} (or torch.bfloat16/torch.float32), got {choice!r}")
    if choice == "auto":
        return torch.bfloat16 if has_fast_bf16_matmul(device) else torch.float32
    return getattr(torch, choice)


def warn_if_bf16_is_emulated(bf16_requested: bool, device: torch.device | str) -> bool:
    """One warning when bf16 autocast was asked for on a CPU that only emulates bf16; returns whether it warned."""
    if not bf16_requested or torch.device(device).type != "cpu" or cpu_has_native_bf16():
        return False
    logger.warning(
        f"--bf16 True on a CPU without native bf16 (torch reports {torch.backends.cpu.get_cpu_capability()}, no "
        "AVX-512-BF16 or AMX): bf16 matmuls are emulated here and run 15-100x slower than fp32. "
        "Drop --bf16 to train in fp32."
    )
    return True
