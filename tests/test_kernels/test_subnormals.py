"""Flushing subnormals reaches every intra-op thread (kimi_k3.kernels.subnormals), in a process of its own: the bits
stay set on the threads, and the rest of the suite computes with IEEE subnormals."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import HANG_CEILING_S, ROOT

FLUSHING = """
import json, torch
from kimi_k3.kernels.subnormals import flush_subnormals, subnormal_results
torch.set_num_threads(2)
torch.randn(512, 512).mul(2)  # the OpenMP workers exist before anything is set
seen = {"start": subnormal_results()}
torch.set_flush_denormal(True)
seen["torch's call"] = subnormal_results()
flush_subnormals(True)
seen["flushed"] = subnormal_results()
torch.set_num_threads(3)  # a worker started later copies the bits from this thread
seen["three threads"] = subnormal_results()
flush_subnormals(False)
seen["kept"] = subnormal_results()
print(json.dumps(seen))
"""


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="this CPU cannot flush subnormals")
def test_subnormals_are_flushed_on_every_intra_op_thread_and_kept_again():
    """torch's own call, made once the workers exist, flushes only its thread's share of a two-thread product;
    `flush_subnormals` flushes all of it, also on a worker started afterwards, and keeping them undoes it."""
    result = subprocess.run([sys.executable, "-c", FLUSHING], cwd=ROOT, capture_output=True, text=True, timeout=HANG_CEILING_S)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    products = seen["start"][1]
    assert seen["start"] == [products, products]
    assert 0 < seen["torch's call"][0] < products
    assert seen["flushed"] == [0, products]
    assert seen["three threads"][0] == 0 and seen["three threads"][1] > products
    assert seen["kept"][0] == seen["kept"][1] == seen["three threads"][1]
