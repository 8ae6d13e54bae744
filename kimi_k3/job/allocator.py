"""Run the training job under TCMalloc when the machine has it.

A training step allocates and frees thousands of tensors of up to megabytes. glibc's allocator returns large freed
blocks to the kernel, so the next step faults their pages in again; TCMalloc keeps them, and the default CPU step runs
faster under it with bit-identical results (docs/training-performance.md, "A faster memory allocator"). An allocator
has to be in place before the process starts, so the command-line entry points (`kimi-k3-train`, `python -m kimi_k3.job`)
call `restart_under_tcmalloc` first: on Linux, when no replacement allocator is loaded (TCMalloc, jemalloc, mimalloc: a
user who preloaded one keeps it) and the dynamic loader can find TCMalloc, the process replaces itself (same PID, same
arguments) with one that preloads it, as PyTorch's own CPU launcher (``python -m torch.backends.xeon.run_cpu
--enable-tcmalloc``) does for the script it starts. ``KIMI_K3_ALLOCATOR=system`` keeps the system allocator.
Where torch sees an accelerator (a CUDA GPU, ...) the job trains there and nothing restarts: the allocator serves only
the host's share of the step. `kimi_k3.job.main.main` itself never restarts anything.
"""

import ctypes.util
import os
import sys
from pathlib import Path

import torch

ALLOCATOR_VARIABLE = "KIMI_K3_ALLOCATOR"
ALLOCATOR_CHOICES = ("tcmalloc", "system")
# Set in the restarted process's environment: a loader that ignored the preload must not cause a second restart.
RESTARTED_VARIABLE = "KIMI_K3_ALLOCATOR_RESTARTED"
# The loader's names for TCMalloc, the variant without the heap profiler first.
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")
# Allocators that replace glibc's when preloaded: one of them mapped means the user chose, and nothing restarts.
PRELOADED_ALLOCATORS = {"libtcmalloc": "TCMalloc", "libjemalloc": "jemalloc", "libmimalloc": "mimalloc"}
# TCMalloc reports every allocation above 1 GiB on stderr, routine for the weights of a large model.
QUIET_LARGE_ALLOCATIONS = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 60)}


class AllocatorChoiceError(ValueError):
    pass


def allocator_choice(environ=os.environ) -> str:
    choice = environ.get(ALLOCATOR_VARIABLE, "tcmalloc").strip().lower() or "tcmalloc"
    if choice not in ALLOCATOR_CHOICES:
        raise AllocatorChoiceError(
            f"{ALLOCATOR_VARIABLE} must be one of {', '.join(ALLOCATOR_CHOICES)}, got {environ[ALLOCATOR_VARIABLE]!r}"
        )
    return choice


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> str | None:
    """Path of the `PRELOADED_ALLOCATORS` library mapped into this process (preloaded or linked), if any."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)  # address, permissions, offset, device, inode[, path]
        if len(fields) == 6 and Path(fields[5]).name.startswith(tuple(PRELOADED_ALLOCATORS)):
            return fields[5]
    return None


def allocator_name(library: str | None) -> str:
    """``TCMalloc``, ``jemalloc`` or ``mimalloc`` for a `loaded_allocator` path; ``system`` for None."""
    if library is None:
        return "system"
    return next(name for prefix, name in PRELOADED_ALLOCATORS.items() if Path(library).name.startswith(prefix))


def find_tcmalloc() -> str | None:
    """The loader's name for an installed TCMalloc (e.g. ``libtcmalloc_minimal.so.4``), or None."""
    return next(filter(None, map(ctypes.util.find_library, TCMALLOC_NAMES)), None)


def restart_under_tcmalloc(program: str = "kimi-k3-train") -> None:
    """Replace this process with the same command preloading TCMalloc, where that applies (see the module docstring;
    not for ``--help``); otherwise return. A choice other than `ALLOCATOR_CHOICES` exits with status 2 and a one-line
    message. The restart repeats what the process imported before calling this."""
    try:
        choice = allocator_choice()
    except AllocatorChoiceError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    asks_for_help = not {"-h", "--help"}.isdisjoint(sys.argv[1:])
    if choice == "system" or asks_for_help or not sys.platform.startswith("linux") or loaded_allocator() is not None:
        return
    if torch.accelerator.is_available():  # the step runs on the device: TCMalloc's gain was a CPU step's
        return
    if os.environ.get(RESTARTED_VARIABLE):
        print(f"{program}: warning: the dynamic loader did not preload {os.environ.get('LD_PRELOAD')!r}; running on "
              f"the system allocator", file=sys.stderr)
        return
    library = find_tcmalloc()
    if library is None:
        return
    preload = " ".join(filter(None, (os.environ.get("LD_PRELOAD"), library)))
    environ = {**QUIET_LARGE_ALLOCATIONS, **os.environ, "LD_PRELOAD": preload, RESTARTED_VARIABLE: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ)


def allocator_description() -> str:
    """One line for the job's start: which allocator this process runs under, and how to change it."""
    library = loaded_allocator()
    if library is not None:
        return (f"memory allocator: {allocator_name(library)} ({library}); {ALLOCATOR_VARIABLE}=system keeps the "
                f"system allocator")
    if find_tcmalloc() is None and sys.platform.startswith("linux"):
        return ("memory allocator: the system allocator (TCMalloc not found; with it a CPU training step runs "
                "1.15-1.25x faster: apt-get install libtcmalloc-minimal4)")
    return "memory allocator: the system allocator"
