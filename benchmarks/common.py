"""Timing and reporting helpers shared by the benchmarks.

Every benchmark compares candidates against baselines measured *in the same run*: the candidates of one case are
timed round-robin (A, B, C, A, B, C, ...) and each keeps its fastest repetition. On a shared machine background load
comes and goes; interleaving exposes every candidate to the same load, and the minimum is the least-disturbed run, so
the ratios hold even when the absolute times do not.
"""

import argparse
import datetime
import gc
import json
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Set before transformers loads (so every benchmark imports this module first). The OpenMP wait policy is left as the
# training job runs it (libgomp's default: spin, then sleep); see README.md, "Environment", for OMP_WAIT_POLICY=PASSIVE.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kimi_k3.ablation.report import cpu_name  # noqa: E402
from kimi_k3.job.allocator import allocator_name, loaded_allocator, restart_under_tcmalloc  # noqa: E402
from kimi_k3.kernels.compiled import isa_safe_compile_caches  # noqa: E402
from kimi_k3.optim.precision import cpu_has_native_bf16  # noqa: E402


def time_interleaved(
    candidates: dict[str, Callable[[], object]], repeats: int = 3, warmup: int = 1, slot_seconds: float = 0.25
) -> dict[str, float]:
    """Fastest wall time in seconds of each candidate over ``repeats`` round-robin rounds (after ``warmup`` rounds).

    In every round each candidate gets a time slot: a slow candidate runs once, a fast one as often as fits in
    ``slot_seconds`` (from its first timing), so cheap candidates get enough chances to meet a quiet moment.
    """
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(warmup):
        for name, run in candidates.items():
            best[name] = min(best[name], _timed(run))
    for _ in range(repeats):
        for name, run in candidates.items():
            gc.collect()
            runs = 1 if best[name] == float("inf") else max(1, min(100, int(slot_seconds / best[name])))
            for _ in range(runs):
                best[name] = min(best[name], _timed(run))
    return best


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def compiled_for_these_kernels(function: Callable) -> Callable:
    """``torch.compile(function, dynamic=True)``, every call under `isa_safe_compile_caches` as the project's own
    compiled kernels run: inductor's cache key omits ``ATEN_CPU_CAPABILITY``, so a run restricted to AVX2 would
    otherwise load, and time, the AVX-512 kernels an unrestricted run had cached."""
    compiled = torch.compile(function, dynamic=True)

    def call(*args, **kwargs):
        with isa_safe_compile_caches():
            return compiled(*args, **kwargs)

    return call


def forward_backward(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """A step that runs ``forward`` and back-propagates a scalar of its output; gradients are dropped afterwards."""

    def step() -> None:
        output = forward()
        output = output[0] if isinstance(output, tuple) else output
        output.float().square().mean().backward()

    return step


def in_fresh_process(target: Callable, args: tuple, timeout_s: float) -> dict:
    """``target(*args, queue)`` in a spawned process: the dict it puts on the queue, or why none came within the time."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(*args, queue))
    process.start()
    process.join(timeout_s)
    if process.is_alive():
        process.terminate()
        process.join()
        return {"error": f"not done within {timeout_s} s"}
    return queue.get() if not queue.empty() else {"error": f"the process exited with code {process.exitcode}"}


def zero_grads(*modules_or_tensors) -> None:
    for item in modules_or_tensors:
        tensors = item.parameters() if isinstance(item, torch.nn.Module) else [item]
        for tensor in tensors:
            tensor.grad = None


def machine_description() -> dict:
    """What the numbers were measured on: CPU, threads, library versions, date and the load when the run started."""
    from transformers import __version__ as transformers_version

    return {
        "cpu": cpu_name(),
        # bf16 matmuls are native only with AVX-512-BF16 or AMX: elsewhere they run 15-100x slower than fp32.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "amx": torch.cpu._is_amx_tile_supported(),
        "native_bf16_matmul": cpu_has_native_bf16(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers_version,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # The job runs under TCMalloc where the machine has it (`kimi_k3.job.allocator`); glibc's is slower.
        "allocator": allocator_name(loaded_allocator()),
        **{name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")},
    }


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns`` (missing cells stay empty)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_format_cell(row.get(column)) for column in columns) + " |")
    return "\n".join(lines)


def _format_cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def bench_arguments(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """The command line every benchmark script accepts (``extra`` adds script-specific arguments). Called first
    thing: a process that is to run under TCMalloc, as `kimi-k3-train` does (`restart_under_tcmalloc`), restarts here,
    before anything is measured; ``KIMI_K3_ALLOCATOR=system`` measures under the system allocator."""
    restart_under_tcmalloc(Path(sys.argv[0]).name)
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repetitions (CI smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repetitions per case")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return args


def report(name: str, result: dict, json_path: Path | None = None) -> None:
    """Print one benchmark's tables and optionally save ``{"machine", name: result}`` as JSON."""
    result.setdefault("machine", machine_summary(machine_description()))
    print(render_markdown(name, result))
    if json_path is not None:
        json_path.write_text(json.dumps({"machine": machine_description(), name: result}, indent=2))


def machine_summary(machine: dict) -> str:
    """The one line printed under every table: what the figures were measured on."""
    bf16 = "native bf16" if machine["native_bf16_matmul"] else "bf16 emulated (slow)"
    return (
        f"Measured on {machine['cpu']} ({machine['cpu_capability']}, {bf16}), {machine['torch_threads']} threads, "
        f"OpenMP waiting {machine['OMP_WAIT_POLICY'] or 'as libgomp defaults'}, {machine['allocator']} allocator, "
        f"torch {machine['torch']}, transformers {machine['transformers']}, {machine['date']}, "
        f"load average {machine['load_average_1m']:.2f} at the start."
    )


def render_markdown(name: str, result: dict) -> str:
    parts = [f"### {result.get('title', name)}", ""]
    if result.get("machine"):
        parts += [f"_{result['machine']}_", ""]
    for table in result["tables"]:
        if table.get("caption"):
            parts += [table["caption"], ""]
        parts += [markdown_table(table["rows"], table["columns"]), ""]
    parts += [f"- {note}" for note in result.get("notes", [])]
    return "\n".join(parts).rstrip() + "\n"
