"""Intra-op threads for the training job, chosen from the cores the process can actually get.

torch starts one OpenMP thread per core it sees, and every parallel operator waits for its slowest thread. When other
processes keep some of those cores busy, a thread is descheduled in most operators and the step waits for the
scheduler to run it again, so beside busy neighbours the default step runs many times slower than the same job on one
thread (benchmarks/bench_busy_neighbours.py measures it). So the job counts the cores it may use (its CPU affinity and
a cgroup CPU quota) and the cores other processes keep busy when it starts (the kernel's count of runnable tasks,
sampled), and runs one thread per core left, at least one and at most torch's own default (one per physical core).
``OMP_NUM_THREADS`` set by the user wins. The choice is printed in one line, because the thread count can change the
rounding of some reductions: a run resumed bit for bit needs the same.
"""

import os
import statistics
import time
from pathlib import Path

import torch

THREADS_VARIABLE = "OMP_NUM_THREADS"
# Samples of the run queue at start: enough to see a busy neighbour that sleeps now and then, short next to a job.
RUN_QUEUE_SAMPLES = 20
RUN_QUEUE_INTERVAL_S = 0.025


def usable_cores(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> float:
    """The cores this process may run on: its CPU affinity, lowered by a cgroup CPU quota (v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us``) where one is set, as in containers and CI runners."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc, cgroup_root)
    return min(cores, quota) if quota is not None else float(cores)


def cgroup_cpu_quota(proc: Path, cgroup_root: Path) -> float | None:
    """CPUs' worth of time per period the process's cgroup may use, or None where no quota applies."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # cgroup v2: "max 100000" or "200000 100000"
            fields = read_fields(cgroup_root / relative / "cpu.max")
            if fields and fields[0] != "max":
                return int(fields[0]) / int(fields[1])
        elif "cpu" in controllers.split(","):  # cgroup v1
            quota = read_fields(cgroup_root / "cpu,cpuacct" / relative / "cpu.cfs_quota_us") or read_fields(
                cgroup_root / "cpu" / relative / "cpu.cfs_quota_us")
            period = read_fields(cgroup_root / "cpu,cpuacct" / relative / "cpu.cfs_period_us") or read_fields(
                cgroup_root / "cpu" / relative / "cpu.cfs_period_us")
            if quota and period and int(quota[0]) > 0:
                return int(quota[0]) / int(period[0])
    return None


def read_fields(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except OSError:
        return None


def busy_cores_of_others(loadavg: Path = Path("/proc/loadavg"), samples: int = RUN_QUEUE_SAMPLES,
                         interval_s: float = RUN_QUEUE_INTERVAL_S) -> float:
    """Cores kept busy by other processes now: the median count of runnable tasks in ``/proc/loadavg`` (its fourth
    field, ``running/total``), less the one reading it. The load average itself lags by a minute; 0 where the file is
    missing (not Linux)."""
    counts = []
    for _ in range(samples):
        fields = read_fields(loadavg)
        if fields is None:
            return 0.0
        counts.append(int(fields[3].split("/")[0]) - 1)
        time.sleep(interval_s)
    return float(statistics.median(counts))


def default_threads(usable: float, busy: float, ceiling: int) -> int:
    """One thread per core the others leave free, at least one, at most ``ceiling`` and one per usable core."""
    return max(1, min(ceiling, int(usable), round(usable - busy)))


def choose_intra_op_threads(environ=os.environ) -> str:
    """Set torch's intra-op threads for the job (see the module docstring) and return the line that says why."""
    if environ.get(THREADS_VARIABLE):
        return f"intra-op threads: {torch.get_num_threads()} ({THREADS_VARIABLE}={environ[THREADS_VARIABLE]})"
    usable, busy = usable_cores(), busy_cores_of_others()
    threads = default_threads(usable, busy, torch.get_num_threads())
    torch.set_num_threads(threads)
    starved = f", other processes' runnable tasks {busy:g}" if busy >= 0.5 else ""
    return (f"intra-op threads: {threads} ({usable:g} usable cores{starved} at the start; {THREADS_VARIABLE}=N "
            f"chooses, and a bit-for-bit resume needs the same count)")
