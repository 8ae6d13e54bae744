"""Where `torch.compile` spends its time on the default training step, and what to compile instead of the whole model.

Each candidate runs in a fresh process with an empty inductor cache (a first run on a new machine), then once more
with the cache that run left (what a second job on the same machine sees). Per candidate: the first training step
(compilation included), the steady step, a step at a new sequence length and the compiler's own phase times
(`torch._dynamo.utils.compile_times`: tracing, AOT autograd, inductor code generation, the C++ compiler).

- ``eager``: no compilation beyond the fused SiTU-GLU and AttnRes kernels the job attaches.
- ``whole model``: ``torch.compile(model)``.
- ``decoder layers``: ``layer.compile()`` on every decoder layer (regional compilation). The layers of one kind share
  their code, so dynamo traces each kind once and every other layer reuses it.

The step is `step_profile.job_training_step` (forward, loss, backward, Per-Head Muon with its Quantile Balancing and
QK-Clip hooks), batch 8 x 128; the new length is 8 x 96.

    python benchmarks/bench_compile.py                    # all candidates, up to 15 minutes each
    python benchmarks/bench_compile.py --only "decoder layers"
"""

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, in_fresh_process, report  # noqa: E402

CANDIDATES = ("eager", "decoder layers", "whole model")
TIMEOUT_S = 900
STEADY_STEPS = 3
NEW_LENGTH = 96


def compile_candidate(model, candidate: str):
    if candidate == "whole model":
        model.compile()
    elif candidate == "decoder layers":
        for layer in model.model.layers:
            layer.compile()
    elif candidate != "eager":
        raise ValueError(f"candidate must be one of {CANDIDATES}, got {candidate!r}")


def _timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _child(candidate: str, cache_dir: str, queue) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        import torch
        from torch._dynamo.utils import compile_times

        from benchmarks.step_profile import job_training_step

        torch.use_deterministic_algorithms(True)  # as the job's full_determinism
        step = job_training_step()
        compile_candidate(step.model, candidate)
        first = _timed(step)
        steady = min(_timed(step) for _ in range(STEADY_STEPS))
        full_length = step.input_ids
        step.input_ids = full_length[:, :NEW_LENGTH]
        new_length = _timed(step)
        step.input_ids = full_length
        back = _timed(step)
        phases = compile_times(repr="csv", aggregate=True)
        queue.put({"first step s": first, "steady step s": steady, f"new length (T={NEW_LENGTH}) step s": new_length,
                   "back to T=128 s": back, "compiler phases": dict(zip(phases[0], phases[1])) if phases else {}})
    except Exception as error:  # report why the candidate is not usable here, whatever the failure
        queue.put({"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}",
                   "where": traceback.format_exc().strip().splitlines()[-3][:200]})


def run(candidates=CANDIDATES) -> dict:
    rows, notes = [], []
    for candidate in candidates:
        with tempfile.TemporaryDirectory(prefix="kimi-k3-inductor-") as cache_dir:
            for cache in ("cold cache", "warm cache"):
                result = in_fresh_process(_child, (candidate, cache_dir), TIMEOUT_S)
                phases = result.pop("compiler phases", None)
                rows.append({"candidate": candidate, "inductor cache": cache, **result})
                if phases:
                    notes.append(f"{candidate}, {cache}: compiler phase seconds {phases}")
                if candidate == "eager":
                    break
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return {"title": "torch.compile of the default training step (batch 8 x 128)",
            "tables": [{"caption": "Seconds per training step; a fresh process per row.", "columns": columns,
                        "rows": rows}],
            "notes": notes}


def main() -> None:
    args = bench_arguments(__doc__, extra=lambda parser: parser.add_argument(
        "--only", nargs="+", choices=CANDIDATES, default=list(CANDIDATES), help="the candidates to measure"))
    report("compile", run(args.only), args.json)


if __name__ == "__main__":
    main()
