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

from configuration_kimi_k3 import KimiK3Config  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# A 9-layer model with every invariant of the released configuration (KimiK3Config checks them) at toy widths: runs a forward in milliseconds.
TINY_CONFIG = {
    "vocab_size": 97,
    "hidden_size": 32,
    "num_hidden_layers": 9,
    "num_attention_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 12,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8, 9],
        "num_heads": 2,
        "head_dim": 8,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
    "intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 2,
    "moe_intermediate_size": 16,
    "routed_expert_hidden_size": 24,
    "attn_res_block_size": 4,
    "max_position_embeddings": 512,
}


def tiny_config(**overrides) -> KimiK3Config:
    return KimiK3Config(**{**TINY_CONFIG, **overrides})


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


def run_processes(command: list[str], timeout_s: float) -> str:
    """Run a multi-process launch (torchrun, accelerate) from the repository root with one thread per process and
    return its output; fail the test with the output tail on error, killing the whole process group if it outlives
    ``timeout_s``."""
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


def torchrun(script: str, *args: str, nproc: int, timeout_s: float) -> None:
    run_processes([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   script, *args], timeout_s)
