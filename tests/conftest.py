"""Shared test set-up: offline hub, isolated HF cache, deterministic CPU runs, tiny K3 configurations."""

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="kimi-k3-hf-home-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Toy-sized ops gain nothing from intra-op threads, and spinning OpenMP workers collapse throughput when several
# processes share the 2 cores (subprocess tests, parallel runs): one thread keeps the suite fast and predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from configuration_kimi_k3 import TINY, KimiK3Config  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


TINY_CONFIG = TINY  # the fields of `KimiK3Config.tiny()`, for --config_overrides and dict-built configs
tiny_config = KimiK3Config.tiny


class CallCounter:
    """Replaces ``module.name`` (a module-level function) for the test with a wrapper that counts its calls: which
    code path ran, where both paths give the same numbers."""

    def __init__(self, monkeypatch, module, name: str):
        self.function, self.calls = getattr(module, name), 0
        monkeypatch.setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def config() -> KimiK3Config:
    return tiny_config()


ROOT = Path(__file__).resolve().parents[1]


# The one time limit of a test's subprocess: a ceiling that only a hang reaches. A correctness test never depends on
# how fast the machine is; on 2 cores shared with other jobs a correct run takes many times its idle duration.
HANG_CEILING_S = 3600


def run_processes(command: list[str], timeout_s: float = HANG_CEILING_S) -> str:
    """Run a multi-process launch (torchrun, accelerate) from the repository root with one thread per process and
    return its output; fail the test with the output tail on error, killing the whole process group if it outlives
    ``timeout_s`` (a hang)."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the multi-process run did not finish within {timeout_s} s:\n{output[-6000:]}")
    if process.returncode != 0:
        pytest.fail(f"the multi-process run failed (exit code {process.returncode}):\n{output[-6000:]}")
    return output


def torchrun(script: str, *args: str, nproc: int, timeout_s: float = HANG_CEILING_S) -> None:
    run_processes([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   script, *args], timeout_s)


# ---------------------------------------------------------------------------------------------------------------------
# The device the model-side tests run on
# ---------------------------------------------------------------------------------------------------------------------
# `KIMI_K3_TEST_DEVICE=cuda python -m pytest -m "device and not distributed" tests/` runs the tests marked `device`
# (the model files' kernels, packing, caching, generation and modeling tests) with every tensor they create without
# naming a device on that device, through torch's default-device context; the tolerances stay the float64-derived
# ones of tests/numerics.py. The CPU is the default, and CI's device.
TEST_DEVICE = torch.device(os.environ.get("KIMI_K3_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
    raise pytest.UsageError(f"KIMI_K3_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device; use 'cpu' (the default).")


@pytest.fixture(autouse=True)
def _on_test_device(request):
    if TEST_DEVICE.type == "cpu" or request.node.get_closest_marker("device") is None:
        yield
        return
    with torch.device(TEST_DEVICE):
        yield


def seeded_generator(seed: int) -> torch.Generator:
    """A seeded generator on the test device: a CPU generator cannot draw the tensors a device test creates there."""
    return torch.Generator(TEST_DEVICE).manual_seed(seed)
