"""The default training step on a machine shared with busy processes: the job's thread choice against one thread.

`kimi-k3-train` runs one intra-op thread per core that other processes leave free at its start
(`kimi_k3.job.threads`). Here the default job step (`step_profile.job_training_step`) runs idle and beside 1 and 2
busy neighbour processes (pure-Python spin loops, started and stopped by this script, each bounded in time), at the
threads the job would choose under that load, at one thread, and at torch's own default (one thread per physical
core, what the job ran before it chose). The candidates of each load alternate step by step and each keeps its
median step time: under a steady neighbour every step is disturbed, and the median shows the typical one.
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, report  # noqa: E402
from benchmarks.step_profile import job_training_step  # noqa: E402
import torch  # noqa: E402
from kimi_k3.job.threads import busy_cores_of_others, default_threads, usable_cores  # noqa: E402

NEIGHBOURS = (0, 1, 2)
# A neighbour spins for at most this long even if this script dies without stopping it.
NEIGHBOUR_LIFETIME_S = 900
SPIN = "import time\ndeadline = time.monotonic() + {seconds}\nwhile time.monotonic() < deadline:\n    pass\n"
SETTLE_S = 1.0


def start_neighbours(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=NEIGHBOUR_LIFETIME_S)]) for _ in range(count)]


def stop(neighbours: list[subprocess.Popen]) -> None:
    for process in neighbours:
        process.terminate()
    for process in neighbours:
        process.wait()


def median_step_times(step, thread_counts: dict[str, int], rounds: int) -> dict[str, float]:
    """Median seconds per step of each candidate, the candidates alternating step by step (after one warm-up)."""
    times = {name: [] for name in thread_counts}
    for round_index in range(rounds + 1):
        for name, threads in thread_counts.items():
            torch.set_num_threads(threads)
            start = time.perf_counter()
            step()
            if round_index:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def one_load(step, neighbours: int, torch_default: int, rounds: int) -> dict:
    processes = start_neighbours(neighbours)
    try:
        time.sleep(SETTLE_S)
        usable, busy = usable_cores(), busy_cores_of_others()
        chosen = default_threads(usable, busy, torch_default)
        candidates = {"job": chosen, "one": 1, "torch": torch_default}
        times = median_step_times(step, candidates, rounds)
    finally:
        stop(processes)
    return {
        "busy neighbours": neighbours,
        "runnable tasks of others": busy,
        "job's threads": chosen,
        "job step ms": 1e3 * times["job"],
        "1 thread ms": 1e3 * times["one"],
        f"torch default ({torch_default}) ms": 1e3 * times["torch"],
        "job / 1 thread": times["job"] / times["one"],
        "job / torch default": times["job"] / times["torch"],
    }


def run(quick: bool = False, repeats: int | None = None) -> dict:
    torch_default = torch.get_num_threads()
    step = job_training_step(2, 64) if quick else job_training_step()
    rounds = repeats or (2 if quick else 5)
    rows = [one_load(step, count, torch_default, rounds) for count in NEIGHBOURS]
    torch.set_num_threads(torch_default)
    return {
        "title": "The default training step beside busy processes",
        "tables": [{"caption": f"Median of {rounds} steps per candidate, candidates alternating; ratios below 1: the "
                               "job's choice is faster.", "columns": list(rows[0]), "rows": rows}],
        "notes": [f"usable cores (affinity, cgroup quota): {usable_cores():g}; a neighbour is a pure-Python spin loop"],
    }


def main() -> None:
    args = bench_arguments(__doc__)
    report("busy_neighbours", run(args.quick, args.repeats), args.json)


if __name__ == "__main__":
    main()
