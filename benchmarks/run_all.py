"""Run the performance benchmarks, print one markdown report and write every number to JSON.

    python -m benchmarks.run_all --quick                 # smoke run, a few minutes on two cores
    python benchmarks/run_all.py                         # full shapes (P1-P6), about ten minutes on two cores
    python benchmarks/run_all.py --only kda moe --threads 1 --json /tmp/kda_moe.json
    python benchmarks/run_all.py --with-extras           # also the Trainer runs of the optimizer and balancing

Every table reports ratios against baselines measured in the same run (min of interleaved repetitions), so they hold
on a loaded machine even when the absolute times do not; the load average at the start is recorded with the machine.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

BENCHMARK_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARK_DIR.parent))  # run from a checkout without installing

from benchmarks import (  # noqa: E402
    bench_decode,
    bench_e2e,
    bench_kda,
    bench_moe,
    bench_optimizer,
    bench_router,
    bench_situ,
    bench_split_muon,
)
from benchmarks.common import bench_arguments, machine_description, machine_summary, render_markdown  # noqa: E402

BENCHMARKS = {
    "kda": bench_kda,
    "moe": bench_moe,
    "situ": bench_situ,
    "optimizer": bench_optimizer,
    "optimizer_split": bench_split_muon,
    "router": bench_router,
    "decode": bench_decode,
    "e2e": bench_e2e,
}
# Training runs with their own command lines (minutes each): run as they are, their output kept verbatim.
EXTRA_SCRIPTS = {"optimizer_training": ["bench_optimizer.py", "--skip-timing"], "balancing": ["bench_balancing.py"]}


def run_extra(command: list[str]) -> dict:
    path = BENCHMARK_DIR / command[0]
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, str(path), *command[1:]], capture_output=True, text=True, check=False)
    return {"returncode": completed.returncode, "seconds": time.perf_counter() - start, "stdout": completed.stdout}


def main() -> None:
    args = bench_arguments(__doc__, extra=_add_selection_arguments)
    machine = machine_description()
    print("## Kimi K3 performance benchmarks\n")
    print("\n".join(f"- {key}: {value}" for key, value in machine.items()), "\n", sep="")
    results = {"machine": machine, "quick": args.quick}
    for name in args.only:
        start = time.perf_counter()
        result = {"machine": machine_summary(machine_description()), **BENCHMARKS[name].run(args.quick, args.repeats)}
        result["seconds"] = time.perf_counter() - start
        results[name] = result
        print(render_markdown(name, result), flush=True)
    if args.with_extras:
        for name, command in EXTRA_SCRIPTS.items():
            results[name] = run_extra(command)
            print(f"### {' '.join(command)}\n\n```\n{results[name]['stdout']}```\n", flush=True)
    json_path = args.json or BENCHMARK_DIR / ("results-quick.json" if args.quick else "results.json")
    json_path.write_text(json.dumps(results, indent=2))
    print(f"Results written to {json_path}")


def _add_selection_arguments(parser) -> None:
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS),
                        help="benchmarks to run (default: all)")
    parser.add_argument("--with-extras", action="store_true",
                        help="also run " + ", ".join(" ".join(command) for command in EXTRA_SCRIPTS.values()))


if __name__ == "__main__":
    main()
