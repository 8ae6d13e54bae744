"""`kimi-k3-convert` ends every failure in one line: a write stopped by the file size limit or a full disk names that
cause (safetensors reports it as its own error, not an OSError), and a missing source folder is named as such."""

import os
import subprocess
import sys
from pathlib import Path

from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import HANG_CEILING_S, tiny_config

REPO = Path(__file__).resolve().parents[2]
CONVERT_UNDER_A_FILE_SIZE_LIMIT = """
import resource, sys
from kimi_k3.checkpoint import convert
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
sys.exit(convert.main(["to-release", sys.argv[1], sys.argv[2], "--no_progress"]))
"""


def test_a_write_past_the_file_size_limit_is_one_line_naming_the_limit_and_leaves_no_target(tmp_path):
    source = tmp_path / "ours"
    # Expert widths in whole MXFP4 groups of 32, so that the model converts; its shard is far above 20 kB.
    KimiK3ForCausalLM(tiny_config(routed_expert_hidden_size=32, moe_intermediate_size=32)).save_pretrained(source)
    target = tmp_path / "released"
    result = subprocess.run(
        [sys.executable, "-c", CONVERT_UNDER_A_FILE_SIZE_LIMIT, str(source), str(target)], capture_output=True,
        text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=HANG_CEILING_S,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"kimi-k3-convert: error: writing {target} failed (the file size limit, ulimit -f, was reached), nothing "
        "partial was left: "
    ), result.stderr[-2000:]
    assert not target.exists() and [path.name for path in tmp_path.iterdir()] == ["ours"]
