"""The default training job (`kimi-k3-train`, 150 steps on the embedded corpus) for the release default and each
opt-in Stable LatentMoE variant, one after another, each in a fresh process: eval perplexity, MaxVio, step time.

Every run is the job with its defaults (Per-Head Muon, Quantile Balancing, QK-Clip, fused SiTU-GLU and AttnRes) plus the
variant's ``--config_overrides`` (expert merging: its job flags). The step time is the median wall time from a
step's start to the end of its callbacks (balancing update, expert merging), over the steps after the first ten
(the first compiles the fused kernels); evaluations and checkpoint saves fall outside it. Runs are sequential: on a
shared two-core machine, parallel runs would time each other.

    python benchmarks/train_variants.py                      # all runs, 150 steps each (about 40 min here)
    python benchmarks/train_variants.py --max_steps 30 --only "release default" "dynamic k (k in [1, 8])"
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_variants import VARIANTS  # noqa: E402
from benchmarks.common import machine_description, markdown_table  # noqa: E402

RUNS = {name: ["--config_overrides", json.dumps(fields)] if fields else [] for name, fields in VARIANTS.items()}
RUNS["expert merging (every 25 steps, cosine >= 0)"] = [
    "--expert_merging_every_n_steps", "25", "--expert_merging_threshold", "0.0", "--expert_merging_max_per_layer", "1",
]
BASELINE = "release default"
WARMUP_STEPS = 10

# Runs the job in this fresh process with a callback that times each optimizer step and reads the step's loads.
JOB = """
import json, statistics, sys, time
from transformers import TrainerCallback
from kimi_k3.job import main as job
from kimi_k3.policies.quantile_balancing import QuantileBalancingCallback

class StepRecorder(TrainerCallback):
    def __init__(self, trainer):
        self.balancing = next(cb.policy for cb in trainer.callback_handler.callbacks
                              if isinstance(cb, QuantileBalancingCallback))
        self.tokens = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
        self.seconds, self.active = [], []
    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.start)
        loads = self.balancing.latest_loads.values()
        self.active.append(sum(int(load.sum()) for load in loads) / len(loads))

build_trainer = job.build_trainer
recorders = []
def build_and_record(*args, **kwargs):
    trainer = build_trainer(*args, **kwargs)
    recorders.append(StepRecorder(trainer))
    trainer.add_callback(recorders[-1])
    return trainer
job.build_trainer = build_and_record
status = job.main(sys.argv[2:])
recorder = recorders[0]
json.dump({"status": status, "step_seconds": recorder.seconds, "routes_per_step": recorder.active,
           "block_tokens": recorder.tokens}, open(sys.argv[1], "w"))
"""


def run(name: str, extra: list[str], output: Path, max_steps: int) -> dict:
    stats_file = output / "step_stats.json"
    argv = ["--output_dir", str(output / "run"), "--max_steps", str(max_steps), *extra]
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", JOB, str(stats_file), *argv], cwd=ROOT, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: the job failed:\n{result.stderr[-3000:]}")
    recorded = json.loads(stats_file.read_text())
    state = json.loads(max((output / "run").glob("checkpoint-*/trainer_state.json"), key=_step).read_text())
    history = state["log_history"]
    train_logs = [entry for entry in history if "loss" in entry]
    evaluation = [entry for entry in history if "eval_loss" in entry][-1]
    block_size = 128
    steps = recorded["step_seconds"][WARMUP_STEPS:]
    return {
        "run": name,
        "first loss": train_logs[0]["loss"],
        "last loss": train_logs[-1]["loss"],
        "finite": all(entry["loss"] == entry["loss"] for entry in train_logs),
        "eval perplexity": evaluation["eval_perplexity"],
        "MaxVio (last logged step)": train_logs[-1].get("balance/max_vio"),
        "MaxVio (mean over logged steps)": statistics.mean(e["balance/max_vio"] for e in train_logs if "balance/max_vio" in e),
        "mean active experts": statistics.mean(recorded["routes_per_step"][WARMUP_STEPS:])
        / (recorded["block_tokens"] * block_size),
        "expert merges": sum(entry.get("expert_merging/merges", 0) for entry in train_logs),
        "step ms (median)": 1e3 * statistics.median(steps),
        "job wall s": time.perf_counter() - start,
    }


def _step(path: Path) -> int:
    return int(path.parent.name.split("-")[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=150)
    parser.add_argument("--only", nargs="*", default=None, help="run names (default: all)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "variants_training.json")
    args = parser.parse_args()
    names = args.only or list(RUNS)
    machine = machine_description()
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="kimi-k3-variant-") as folder:
            rows.append(run(name, RUNS[name], Path(folder), args.max_steps))
            print(json.dumps(rows[-1]), flush=True)
    baseline = next((row for row in rows if row["run"] == BASELINE), None)
    for row in rows:
        row["step time vs release"] = row["step ms (median)"] / baseline["step ms (median)"] if baseline else None
    columns = ["run", "eval perplexity", "MaxVio (last logged step)", "MaxVio (mean over logged steps)",
               "mean active experts", "expert merges", "step ms (median)", "step time vs release", "finite"]
    print(markdown_table(rows, columns))
    args.json.write_text(json.dumps({"machine": machine, "max_steps": args.max_steps, "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
