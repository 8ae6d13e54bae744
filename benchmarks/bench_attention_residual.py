"""Block AttnRes alone: one mix of a partial sum and three block snapshots, at the default training step's shape
(8 x 128 tokens, hidden 256) and at K3's hidden width (7,168; 1,024 tokens, 256 with --quick).

Candidates, timed interleaved, forward and forward+backward (the gradients of the partial sum, the snapshots and
both weights):
- eager: `block_attention_residual`, the model's reference (its norm and pseudo-query run their own forwards);
- fused: `fused_attention_residual`, what training uses: the reference on its weights as tensors, compiled with its
  backward (AOTAutograd), the backward compiled with the forward so that a failure falls back to the reference;
- `torch.compile` of the reference as the model calls it (modules as arguments), the same compilation without the
  fallback.

Compilation happens in the warm-up round and is not timed.

    python benchmarks/bench_attention_residual.py [--quick]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, compiled_for_these_kernels, report, time_interleaved  # noqa: E402
import torch  # noqa: E402
from kimi_k3.kernels.fused_attention_residual import fused_attention_residual  # noqa: E402
from modeling_kimi_k3 import KimiK3PseudoQuery, KimiK3RMSNorm, block_attention_residual  # noqa: E402

SNAPSHOTS = 3  # the bank before the default model's output mix, and before its last layers' feed-forward mixes
K3_HIDDEN = 7168


def case(shape: tuple[int, int, int], repeats: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    hidden = shape[-1]
    proj, norm = KimiK3PseudoQuery(hidden), KimiK3RMSNorm(hidden, eps=1e-5)
    torch.nn.init.normal_(proj.weight, generator=generator)
    block_sum = torch.randn(*shape, generator=generator).requires_grad_()
    bank = torch.randn(*shape[:-1], SNAPSHOTS, hidden, generator=generator).requires_grad_()
    grad_output = torch.randn(*shape, generator=generator)
    tensors = (block_sum, bank, norm.weight, proj.weight)
    candidates = {
        "eager block_attention_residual": block_attention_residual,
        "fused_attention_residual (training)": fused_attention_residual,
        "torch.compile(block_attention_residual)": compiled_for_these_kernels(block_attention_residual),
    }
    timed = {}
    for name, mix in candidates.items():
        timed[f"{name}|fwd"] = lambda m=mix: m(block_sum.detach(), bank.detach(), proj, norm)
        timed[f"{name}|train"] = lambda m=mix: torch.autograd.grad(m(block_sum, bank, proj, norm), tensors,
                                                                   grad_output)
    seconds = time_interleaved(timed, repeats=repeats, warmup=1)
    eager = seconds["eager block_attention_residual|train"]
    return [
        {
            "shape": f"{list(shape)} + {SNAPSHOTS} snapshots",
            "candidate": name,
            "fwd ms": 1e3 * seconds[f"{name}|fwd"],
            "fwd+bwd ms": 1e3 * seconds[f"{name}|train"],
            "fwd+bwd speedup vs eager": eager / seconds[f"{name}|train"],
        }
        for name in candidates
    ]


def run(quick: bool = False, repeats: int | None = None) -> dict:
    shapes = [(8, 128, 256), (1, 256 if quick else 1024, K3_HIDDEN)]
    rows = [row for shape in shapes for row in case(shape, repeats or 5)]
    return {
        "title": "Block AttnRes, one mix (fp32)",
        "tables": [{"caption": "", "columns": list(rows[0]), "rows": rows}],
        "notes": ["fwd: on inputs without grad (the fused function called directly: in a model, inference keeps the "
                  "reference); fwd+bwd: with every gradient, as in training."],
    }


def main() -> None:
    args = bench_arguments(__doc__)
    report("attention_residual", run(args.quick, args.repeats), args.json)


if __name__ == "__main__":
    main()
