"""``torch.compile`` for kernels attached from outside the model: compiled once per process, with the eager function
as the fallback whenever compilation is impossible (no C++ compiler for inductor's CPU code, no Triton on a GPU)."""

import contextlib
import os
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode
from transformers.utils import logging

logger = logging.get_logger(__name__)


def isa_safe_compile_caches() -> contextlib.AbstractContextManager:
    """Inductor's FX graph cache with the CPU's own kernels; without it when ``ATEN_CPU_CAPABILITY`` restricts them.

    The cache key does not include that restriction (torch 2.13): a kernel cached by a process restricted to AVX2 on
    an AVX-512 CPU, read back by an unrestricted process on the same machine (or the other way round), computes wrong
    values and writes out of bounds. A restricted process therefore neither reads nor writes the cache.
    """
    if not os.environ.get("ATEN_CPU_CAPABILITY"):
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fx_graph_cache=False)


def backward_compiled_with_forward() -> contextlib.AbstractContextManager:
    """AOTAutograd compiling a differentiable function's backward when it compiles the forward, not at the first
    ``loss.backward()``: a failure then surfaces in the forward call, where the eager function can take over."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def leading_dims_dynamic(args: tuple) -> None:
    """Every dim but the last of each tensor in ``args`` marked dynamic for a ``torch.compile(dynamic=False)``
    function (``torch._dynamo.maybe_mark_dynamic``: a dim of size 1 may still be specialised)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            for dim in range(arg.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(arg, dim)


class CompiledFunction:
    """``function`` compiled by ``torch.compile`` on first call, with dynamic shapes, shared by all its callers.

    One instance per function keeps one compilation cache per process instead of one per layer. Inside an
    already-compiled region the eager function is traced into the outer graph instead, and under a ``TorchDispatchMode``
    (a FLOP counter, a recorder of operators) the eager function runs, so that the mode sees its operators: a compiled
    call under a mode leaves the function slower than eager for the rest of the process, without an error (torch 2.13;
    benchmarks/records/2026-12-03_muon_elementwise_passes_xeon-amx.md). If compilation fails (no C++ compiler for
    inductor's CPU code, no Triton on a GPU, a Python that dynamo does not support) the eager function is used from
    then on, after one warning; the kernel's own runtime errors (e.g. out of memory) propagate.

    ``differentiable=True`` is for a function called on tensors that require grad: AOTAutograd derives its backward,
    and compiles it with the forward (`backward_compiled_with_forward`), so that a backward that cannot be compiled
    falls back like a forward that cannot. ``static_widths=True`` compiles the last dim of every tensor argument as a
    constant, one compilation per width met, and the other dims dynamic (`leading_dims_dynamic`): for elementwise
    kernels over a model's few fixed widths, whose vectorised loops over a dynamic innermost size ran slower
    (SiTU-GLU, torch 2.13; benchmarks/records/2026-12-03_situ_tanh_from_exp_xeon-amx.md). ``backend`` and ``options`` (the compiler's settings) are ``torch.compile``'s.
    """

    def __init__(self, function: Callable, skip_hint: str = "train with --no_fused_situ to skip the attempt",
                 differentiable: bool = False, backend: str | Callable = "inductor", options: dict | None = None,
                 static_widths: bool = False):
        self.function = function
        self.skip_hint = skip_hint
        self.differentiable = differentiable
        self.backend = backend
        self.options = options
        self.static_widths = static_widths
        self.compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args):
        if self.failed or torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
            return self.function(*args)
        if self.compiled is None:
            try:
                self.compiled = torch.compile(self.function, dynamic=not self.static_widths, backend=self.backend,
                                              options=self.options)
            except RuntimeError as error:
                return self._fall_back(error, args)
        if self.static_widths:
            leading_dims_dynamic(args)
        backward = backward_compiled_with_forward() if self.differentiable else contextlib.nullcontext()
        try:
            with isa_safe_compile_caches(), backward:
                return self.compiled(*args)
        except Exception as error:
            from torch._dynamo.exc import TorchDynamoException  # loaded by the compiled call

            if not isinstance(error, TorchDynamoException):
                raise
            return self._fall_back(error, args)

    def _fall_back(self, error: Exception, args: tuple):
        self.failed = True
        reason = (str(error).strip().splitlines() or [""])[0]
        logger.warning(
            f"torch.compile of `{self.function.__name__}` failed, using the eager PyTorch version from now on "
            f"({self.skip_hint}): {type(error).__name__}: {reason}"
        )
        return self.function(*args)
