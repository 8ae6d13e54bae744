"""The elementwise passes of a Per-Head Muon step, one compiled loop each on large parameters.

Around Newton–Schulz a Muon step reads and writes every parameter element several times: momentum is two passes
(``mul_``, ``add_``), the Nesterov update a third that allocates an fp32 tensor which Newton–Schulz then reads once
more to round it to bf16, and decoupled decay with the update two more, the second a mixed-dtype add (fp32 parameter,
bf16 update), torch's slowest elementwise path on a CPU. Each function below is one of these passes written as the
plain torch expression it computes; :func:`run` calls it compiled (``torch.compile``: inductor makes one loop of it,
with the rounding to Newton–Schulz's dtype inside) for parameters of at least :data:`COMPILED_MIN_ELEMENTS`
elements, and eager below, where a compiled call's fixed cost is more than the passes it saves. Where
the step forms its update once (one process, DDP), momentum and the update are one loop
(:func:`momentum_and_nesterov_update_`).

Eager and compiled round identically: every product and every sum is rounded on its own in both (inductor builds its
CPU kernels with ``-ffp-contract=off`` and these expressions give it no fused multiply-add to emit), and to the
tensor's dtype after every operation for 16-bit parameters too (inductor's ``emulate_precision_casts``; it otherwise
keeps bf16 intermediates in fp32), so which of the two runs a parameter, by size, by layout, or because compilation
failed, never changes a bit of the update. ``tests/optim/test_elementwise.py`` pins that on odd lengths and strided
tensors, and the distributed Per-Head Muon tests hold FSDP2 and DDP steps of the default model (compiled on the
shards) to the single process bit for bit. On a GPU, Triton may fuse a multiply-add that eager rounds twice; the
choice of path still does not depend on the layout (the size tested is the parameter's, not the shard's, and shards
laid out alike run compiled), so ranks agree there too, apart from a ``DTensor`` mixed with plain or differently laid
out tensors, which runs eager.
"""

import torch
from torch.distributed.tensor import DTensor

from kimi_k3.kernels.compiled import CompiledFunction

# Elements from which the compiled loops beat eager's passes on a CPU (`benchmarks/bench_optimizer.py`, last table;
# measured in benchmarks/records/2026-12-03_muon_elementwise_passes_xeon-amx.md): the default model's expert tensors
# (2^20-2^21) run compiled, its attention projections (2^15-2^16) eager.
COMPILED_MIN_ELEMENTS = 2**18


def advance_momentum_(buffer: torch.Tensor, grad: torch.Tensor, momentum: float) -> torch.Tensor:
    """``buffer <- momentum * buffer + grad``, in place."""
    return buffer.mul_(momentum).add_(grad)


def nesterov_update(grad: torch.Tensor, buffer: torch.Tensor, momentum: float, dtype: torch.dtype) -> torch.Tensor:
    """``grad + momentum * buffer`` (Nesterov's look-ahead) in ``dtype``, the dtype Newton–Schulz runs in."""
    return (grad + buffer * momentum).to(dtype)


def momentum_and_nesterov_update_(buffer: torch.Tensor, grad: torch.Tensor, momentum: float,
                                  dtype: torch.dtype) -> torch.Tensor:
    """`advance_momentum_` then `nesterov_update`, the same bits in one pass: the gradient and the momentum are read
    once for both (the single-process and replicated steps; the sharded step forms its update twice)."""
    return nesterov_update(grad, advance_momentum_(buffer, grad, momentum), momentum, dtype)


def decay_and_add_(param: torch.Tensor, update: torch.Tensor, decay: float, alpha: float) -> torch.Tensor:
    """``param <- decay * param + alpha * update``, in place, in the parameter's dtype (decoupled weight decay and
    the scaled orthogonalised update)."""
    return param.mul_(decay).add_(update.to(param.dtype) * alpha)


_HINT = "Per-Head Muon then runs its elementwise passes eagerly, with the same results"


def compiled_passes() -> dict:
    """A `CompiledFunction` of each pass, by pass: every one keeps its own compilation (or failure)."""
    return {
        function: CompiledFunction(function, skip_hint=_HINT, options={"emulate_precision_casts": True})
        for function in (advance_momentum_, nesterov_update, momentum_and_nesterov_update_, decay_and_add_)
    }


COMPILED = compiled_passes()


def run(function, *args):
    """``function(*args)``, compiled where the first tensor (the parameter-sized one) has at least
    :data:`COMPILED_MIN_ELEMENTS` elements, eager below. ``DTensor`` arguments laid out alike (an FSDP2 or expert-
    parallel parameter with its gradient and momentum) run compiled on their local shards, elementwise as the
    passes are; any other mix runs eager on the ``DTensor``s."""
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    if tensors[0].numel() < COMPILED_MIN_ELEMENTS:
        return function(*args)
    sharded = [tensor for tensor in tensors if isinstance(tensor, DTensor)]
    if not sharded:
        return COMPILED[function](*args)
    first = sharded[0]
    if len(sharded) < len(tensors) or not all(_laid_out_alike(tensor, first) for tensor in sharded):
        return function(*args)
    local_args = [arg.to_local() if isinstance(arg, DTensor) else arg for arg in args]
    result = COMPILED[function](*local_args)
    for arg, local in zip(args, local_args):
        if result is local:  # an in-place pass returns its (sharded) first argument
            return arg
    return DTensor.from_local(result, first.device_mesh, first.placements, run_check=False, shape=first.shape,
                              stride=first.stride())


def _laid_out_alike(tensor: DTensor, first: DTensor) -> bool:
    return (tensor.shape, tensor.device_mesh, tensor.placements) == (first.shape, first.device_mesh, first.placements)
