"""Streaming checkpoint conversion (kimi_k3.checkpoint.release_format): time and peak memory of both directions.

Each conversion runs in a fresh process that first converts a small checkpoint (imports, one-off allocations), then
resets its resident-memory high-water mark (Linux /proc/self/clear_refs) and converts the measured checkpoint; the
peak is VmHWM minus VmRSS at the reset. A streaming converter's peak follows the shard size, not the model size.
Times are single runs (one process per conversion, with this process's torch thread count), so they carry the
machine's background load. Input checkpoints are sharded like the output: an input shard stays mapped while read.

    python benchmarks/bench_convert.py            # ~130 and ~430 MB checkpoints, 8 and 32 MiB shards
    python benchmarks/bench_convert.py --quick    # ~130 MB, 8 MiB shards
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from benchmarks.common import bench_arguments, report  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.checkpoint.release_format import export_released  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402

# (routed expert width for both latent and intermediate, shard MiB); the default small KimiK3Config otherwise.
FULL_CASES = [(128, 8), (128, 32), (256, 8)]
QUICK_CASES = [(128, 8)]
DIRECTIONS = ("to-release", "from-release")  # from-release reads what to-release wrote

_CONVERT_AND_MEASURE = """
import json, sys, time
from kimi_k3.checkpoint.release_format import export_released, import_released

def status_mib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith(field))

direction, warm_up_source, warm_up_target, source, target, shard_bytes = sys.argv[1:]
convert = {"to-release": export_released, "from-release": import_released}[direction]
convert(warm_up_source, warm_up_target, progress=False)
with open("/proc/self/clear_refs", "w") as clear_refs:
    clear_refs.write("5")
start_rss, start = status_mib("VmRSS"), time.perf_counter()
convert(source, target, max_shard_bytes=int(shard_bytes), progress=False)
print(json.dumps({"seconds": time.perf_counter() - start, "peak_mib": status_mib("VmHWM") - start_rss}))
"""


def save_checkpoint(folder: Path, expert_width: int, shard_mib: int = 8) -> float:
    """Our layout of the default small model with routed experts of the given width; returns its size in MiB."""
    config = KimiK3Config(routed_expert_hidden_size=expert_width, moe_intermediate_size=expert_width)
    KimiK3ForCausalLM(config).save_pretrained(folder, max_shard_size=shard_mib * 2**20)
    return folder_mib(folder)


def folder_mib(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors")) / 2**20


def convert_in_fresh_process(direction: str, warm_up: tuple[Path, Path], source: Path, target: Path, shard_mib: int):
    command = [sys.executable, "-c", _CONVERT_AND_MEASURE, direction, *map(str, (*warm_up, source, target))]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run([*command, str(shard_mib * 2**20)], env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    args = bench_arguments(__doc__.splitlines()[0])
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        save_checkpoint(scratch / "warm-up-ours", expert_width=32)
        export_released(scratch / "warm-up-ours", scratch / "warm-up-released", progress=False)
        warm_up_sources = {"to-release": scratch / "warm-up-ours", "from-release": scratch / "warm-up-released"}
        for expert_width, shard_mib in QUICK_CASES if args.quick else FULL_CASES:
            case = scratch / f"w{expert_width}-s{shard_mib}"
            folders = {"ours": case / "ours", "to-release": case / "released", "from-release": case / "restored"}
            model_mib = save_checkpoint(folders["ours"], expert_width, shard_mib)
            source = folders["ours"]
            for direction in DIRECTIONS:
                warm_up = (warm_up_sources[direction], case / f"warm-up-{direction}")
                measured = convert_in_fresh_process(direction, warm_up, source, folders[direction], shard_mib)
                rows.append(
                    {
                        "direction": direction,
                        "model MiB (ours)": model_mib,
                        "input MiB": folder_mib(source),
                        "shard MiB": shard_mib,
                        "seconds": measured["seconds"],
                        "input MiB/s": folder_mib(source) / measured["seconds"],
                        "peak RSS MiB": measured["peak_mib"],
                        "peak / shard": measured["peak_mib"] / shard_mib,
                    }
                )
                source = folders[direction]
    columns = list(rows[0])
    report(
        "bench_convert",
        {
            "title": "Checkpoint conversion: our layout <-> released layout (MXFP4 experts)",
            "tables": [{"rows": rows, "columns": columns}],
            "notes": [
                "peak RSS = resident-memory high-water mark of the conversion minus the resident set before it",
                "to-release packs experts to MXFP4 (4.25 bits/weight); from-release dequantizes them to the "
                "config dtype (fp32 here)",
            ],
        },
        args.json,
    )


if __name__ == "__main__":
    main()
