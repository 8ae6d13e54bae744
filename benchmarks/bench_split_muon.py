"""P4b: Per-Head Muon with Newton–Schulz split across data-parallel ranks, 1 process against 2.

``run()`` (part of ``run_all.py``) launches the default ``KimiK3Config()`` model under ``torchrun`` with 1 and then
2 processes (gloo, one intra-op thread each, so each rank has one core), alternating the two launches, and in each
measures per rank, after a warm-up step, the fastest of ``repeats`` rounds of:

- the optimizer step with split Newton–Schulz (the default), on fixed random gradients;
- the optimizer step with every rank orthogonalising every block (``split_newton_schulz=False``, the previous
  behaviour; with 1 process the two are the same code path);
- a whole DDP training step (forward, backward with the gradient all-reduce, optimizer step) on the job's default
  per-device batch of 8 x 128 tokens, from which the optimizer's share of a training step follows.

Every rank starts each timed call together (barrier); a row reports the slowest rank. Ratios are against the 1-process
figures of the same run.

    python benchmarks/bench_split_muon.py [--quick]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, report  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.optim.muon import (  # noqa: E402
    NS_STEPS,
    PerHeadMuon,
    build_param_groups,
    muon_shapes_and_patterns,
    newton_schulz_exchange_bytes,
)
from kimi_k3.optim.split_newton_schulz import plan_exchange  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQUENCE = 8, 128


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one rank of a torchrun launch
# ---------------------------------------------------------------------------------------------------------------------
def timed_rounds(candidates: dict, repeats: int) -> dict[str, float]:
    """Fastest time of each candidate over ``repeats`` round-robin rounds; every rank starts every call together."""
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(repeats):
        for name, run in candidates.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def worker(out: Path, repeats: int, batch: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config())
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True, broadcast_buffers=False)
    gradients = {p: torch.randn_like(p) for p in model.parameters()}
    optimizers = {split: PerHeadMuon.for_model(model, lr=1e-4, split_newton_schulz=split) for split in (True, False)}
    tokens = torch.randint(3, model.config.vocab_size, (batch, SEQUENCE), generator=torch.Generator().manual_seed(1))

    def optimizer_step(split):
        for p, grad in gradients.items():
            p.grad = grad.clone()
        optimizers[split].step()

    def training_step():
        ddp(input_ids=tokens, labels=tokens).loss.backward()
        optimizers[True].step()
        optimizers[True].zero_grad()

    candidates = {
        "optimizer step, split NS": lambda: optimizer_step(True),
        "optimizer step, every block on every rank": lambda: optimizer_step(False),
        "training step": training_step,
    }
    for run in candidates.values():  # warm-up: optimizer state, kernels
        dist.barrier()
        run()
    seconds = timed_rounds(candidates, repeats)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seconds)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"seconds_per_rank": everyone, "ns_dtype": str(optimizers[True].ns_dtype)}))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------
def launch(processes: int, repeats: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                   __file__, "--worker", str(out), "--repeats", str(repeats), "--batch", str(batch)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        if completed.returncode != 0:
            raise RuntimeError(f"torchrun with {processes} processes failed:\n{completed.stdout[-3000:]}"
                               f"{completed.stderr[-3000:]}")
        return json.loads(out.read_text())


def slowest_rank(result: dict) -> dict[str, float]:
    ranks = result["seconds_per_rank"]
    return {name: max(rank[name] for rank in ranks) for name in ranks[0]}


def run(quick: bool = False, repeats: int | None = None) -> dict:
    repeats = repeats or 2
    batch = 2 if quick else BATCH
    rounds = 1 if quick else 2
    best = {1: {}, 2: {}}
    for _ in range(rounds):  # alternate the launches, keep each figure's fastest
        for processes in (1, 2):
            result = launch(processes, repeats, batch)
            for name, value in slowest_rank(result).items():
                best[processes][name] = min(best[processes].get(name, float("inf")), value)
    ns_dtype = result["ns_dtype"]
    one = best[1]
    rows = []
    for processes, mode in ((1, "split NS"), (2, "split NS"), (2, "every block on every rank")):
        optimizer = best[processes][f"optimizer step, {mode}"]
        row = {"processes": processes, "Newton–Schulz": "whole (1 rank)" if processes == 1 else mode,
               "optimizer step ms": optimizer * 1e3, "÷ 1 process": optimizer / one["optimizer step, split NS"]}
        if mode == "split NS":
            step = best[processes]["training step"]
            row.update({"training step ms": step * 1e3, "optimizer share": optimizer / step})
        rows.append(row)
    with torch.device("meta"):
        shapes, patterns = muon_shapes_and_patterns(build_param_groups(KimiK3ForCausalLM(KimiK3Config())))
    itemsize = torch.finfo(getattr(torch, ns_dtype.removeprefix("torch."))).bits // 8
    plan = plan_exchange(shapes, patterns, 2, False, NS_STEPS)
    per_rank_gflop = [flops / 1e9 for flops in plan.flops_per_rank()]
    traffic = {layout: newton_schulz_exchange_bytes(shapes, patterns, 2, layout == "FSDP2", itemsize)[0][0] / 2**20
               for layout in ("DDP", "FSDP2")}
    whole_update = sum(torch.Size(shape).numel() for shape in shapes) * 4 / 2 / 2**20
    return {
        "title": "P4b - Per-Head Muon, Newton–Schulz split across ranks, default KimiK3Config(), 1 vs 2 processes",
        "tables": [{"caption": "", "rows": rows, "columns": ["processes", "Newton–Schulz", "optimizer step ms",
                                                             "÷ 1 process", "training step ms", "optimizer share"]}],
        "notes": [
            f"Newton–Schulz in {ns_dtype}; with 2 ranks each does {per_rank_gflop[0]:.1f} / {per_rank_gflop[1]:.1f} "
            f"GFLOP of the {sum(per_rank_gflop):.1f} per step.",
            f"Exchanged per rank and step (sent = received): {traffic['DDP']:.1f} MiB under DDP (all-gather of "
            f"results), {traffic['FSDP2']:.2f} MiB under FSDP2 (only blocks cut by a shard boundary); the FSDP2 "
            f"whole-update all-gather it replaces moved {whole_update:.1f} MiB.",
            f"gloo on one machine, 1 intra-op thread per process, training batch {batch} x {SEQUENCE} tokens per "
            "rank; the slowest rank of each figure, fastest of the rounds.",
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}, load average {os.getloadavg()[0]:.1f} at the "
            "end (another process on the same cores slows 2-process runs more than 1-process ones).",
        ],
    }


def main() -> None:
    if "--worker" in sys.argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", type=Path)
        parser.add_argument("--repeats", type=int)
        parser.add_argument("--batch", type=int)
        args = parser.parse_args()
        worker(args.worker, args.repeats, args.batch)
        return
    args = bench_arguments(__doc__)
    report("split_muon", run(args.quick, args.repeats), args.json)


if __name__ == "__main__":
    main()
