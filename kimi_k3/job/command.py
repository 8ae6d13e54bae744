"""The ``kimi-k3-train`` command (and ``python -m kimi_k3.job``): the job of `kimi_k3.job.main`, in a process that
`restart_under_tcmalloc` may first have replaced with one running under TCMalloc."""

from kimi_k3.job.allocator import restart_under_tcmalloc


def main() -> int:
    restart_under_tcmalloc()
    # Imported after the restart, which then repeats only the package's own imports (torch and transformers), not
    # the job's heavier ones (datasets, Trainer, ...).
    from kimi_k3.job.main import main as run_job

    return run_job()
