"""`CompiledFunction` under a dispatch mode: the mode sees the eager function's operators, and the kernel stays
compiled afterwards (a compiled call under a mode would make dynamo give up on it silently)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_k3.kernels.compiled import CompiledFunction


class OperatorRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.operators = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators.append(func)
        return func(*args, **(kwargs or {}))


def scaled_sum(x, y):
    return x * 3.0 + y


def test_a_dispatch_mode_sees_the_eager_operators_and_the_kernel_stays_compiled():
    kernel = CompiledFunction(scaled_sum)
    x, y = torch.randn(1000), torch.randn(1000)
    before = kernel(x, y)
    assert kernel.compiled is not None
    with OperatorRecorder() as recorder:
        under_mode = kernel(x, y)
    assert {torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor} <= set(recorder.operators)
    assert torch.equal(under_mode, before) and not kernel.failed
    first_mode_call = CompiledFunction(scaled_sum)  # its first call under a mode does not compile, nor fail
    with OperatorRecorder():
        first_mode_call(x, y)
    assert first_mode_call.compiled is None and not first_mode_call.failed
