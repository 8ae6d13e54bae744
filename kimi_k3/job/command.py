"""The ``kimi-k3-train`` command (and ``python -m kimi_k3.job``): the job of `kimi_k3.job.main`, in a process that
`restart_under_tcmalloc` may first have replaced with one running under TCMalloc."""

import sys

from kimi_k3.job.allocator import restart_under_tcmalloc


def main() -> int:
    restart_under_tcmalloc()
    # Imported after the restart, which then repeats only the package's own imports (torch and transformers), not
    # the job's heavier ones (datasets, Trainer, ...). An image-text dataset makes it the vision-language job.
    if any(arg.split("=")[0] == "--image_text_dataset" for arg in sys.argv[1:]):
        from kimi_k3.job.vision import main as run_job
    else:
        from kimi_k3.job.main import main as run_job

    return run_job()
