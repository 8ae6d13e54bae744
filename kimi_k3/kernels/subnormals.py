"""Subnormal floats flushed to zero on every thread that runs this process's CPU kernels.

On x86, arithmetic that reads or produces a subnormal (an fp32 magnitude below 1.2e-38) takes a microcode assist and
runs many times slower. KDA's decays e^γ reach that range once gates are strong: K3's gate lower bound of −5 lets γ fall
to −160 within one 32-token chunk, and the chunk kernel's batched products then run several times slower at the same
shapes (benchmarks/records/2026-12-04_subnormals_every_thread_xeon-amx.md). Setting the CPU's flush-to-zero and denormals-are-zero bits removes that
cost. The price is results that differ from IEEE arithmetic only where a value would have been subnormal.

``torch.set_flush_denormal`` sets the bits of the calling thread alone. ATen's OpenMP workers copy them from the thread
that creates them, so a call made after the first parallel operator leaves the workers as they were and half of a
two-thread kernel unflushed. `flush_subnormals` sets the bits on the calling thread and, where ATen runs on GNU OpenMP
(libgomp, as in the Linux wheels), on every worker of its team, through one parallel region whose body makes the same
call. Then it checks, with a product split across every intra-op thread, that each thread flushes (or keeps)
subnormals as asked.
"""

import ctypes

import torch

__all__ = ["flush_subnormals", "subnormal_results"]

# 1e-20 squared is 1e-40: a subnormal fp32 result unless the thread flushes it to zero.
_TINY = 1e-20
# Elements per intra-op thread in the check: well above ATen's grain size (32,768), so every thread gets a share.
_ELEMENTS_PER_THREAD = 1 << 17

_ON_EACH_THREAD = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def subnormal_results() -> tuple[int, int]:
    """(subnormal results, products) of one fp32 multiply whose products are all subnormal in IEEE arithmetic, split
    across every intra-op thread: 0 subnormal results where every thread flushes."""
    products = torch.full((_ELEMENTS_PER_THREAD * torch.get_num_threads(),), _TINY)
    products.mul_(_TINY)
    return int(products.count_nonzero()), products.numel()


def flush_subnormals(flush: bool = True, check: bool = True) -> None:
    """Flush subnormal floats to zero (``flush=True``) or keep them (``False``) on this thread and every intra-op
    worker of its team. With ``check``, raise ``RuntimeError`` when a thread does not do as asked (a CPU without the
    bits, or OpenMP workers other than libgomp's that already exist)."""
    if not torch.set_flush_denormal(flush) and flush:
        raise RuntimeError("this CPU cannot flush subnormal floats to zero (torch.set_flush_denormal returned False)")
    _on_every_openmp_worker(lambda _: torch.set_flush_denormal(flush))
    if not check:
        return
    subnormal, products = subnormal_results()
    if subnormal != (0 if flush else products):
        raise RuntimeError(
            f"{'flushing' if flush else 'keeping'} subnormals reached only part of the intra-op threads "
            f"({subnormal} of {products} products stayed subnormal): ATen's OpenMP runtime is not libgomp, whose "
            "workers this can reach; call flush_subnormals before the first parallel operator, so that the workers "
            "copy the setting from this thread when they start"
        )


def _on_every_openmp_worker(function) -> None:
    """``function(None)`` on each thread of this thread's OpenMP team, in one libgomp parallel region of ATen's thread
    count; nothing where ATen is not on libgomp."""
    try:
        parallel = ctypes.CDLL(None).GOMP_parallel
    except (AttributeError, OSError, TypeError):  # no libgomp in the process, or no process-wide symbol lookup
        return
    callback = _ON_EACH_THREAD(function)
    parallel.argtypes = [_ON_EACH_THREAD, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    parallel(callback, None, torch.get_num_threads(), 0)
