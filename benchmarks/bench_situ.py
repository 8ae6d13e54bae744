"""P1 detail: SiTU-GLU alone, at the routed experts' activation size of the K3 setting (4096 tokens x top-16 rows,
expert intermediate 384, so [65,536, 768] for [gate ‖ up]).

Candidates, timed interleaved, forward and forward+backward:
- eager: `situ_glu`, a dozen elementwise passes each way (the reference);
- fused: `fused_situ_glu`, what training uses (`FusedSiTUGLU`: a compiled forward that keeps its input and a compiled
  backward that evaluates the derivatives again, tanh from ``exp`` in both);
- autograd-compiled: `torch.compile(situ_glu)`, inductor deriving the backward itself through AOTAutograd; its
  compilation failures surface inside `loss.backward()`, where nothing can fall back, so the model does not use it.
  It runs under the same cache guard as the fused kernels (`compiled_for_these_kernels`): under
  ``ATEN_CPU_CAPABILITY=avx2`` it would otherwise time AVX-512 kernels that an unrestricted run had cached;
- SiLU·up: transformers' experts activation, the cost SiTU-GLU is compared with.

Then eager against fused by activation size, from the default training step's activations up to the K3 experts' at
512 tokens: where the compiled pair starts to pay on this CPU, and which one the model's attachment runs there. Last,
tanh alone at the routed experts' size of the default training step: eager ``torch.tanh``, ``torch.tanh`` as inductor
compiles it, and the kernels' `tanh_from_exp` compiled.

Compilation happens in the warm-up round and is not timed.

    python benchmarks/bench_situ.py [--quick]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, compiled_for_these_kernels, report, time_interleaved  # noqa: E402
from benchmarks.bench_moe import INTERMEDIATE  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kimi_k3.kernels.compiled import CompiledFunction  # noqa: E402
from kimi_k3.kernels.fused_situ import fused_min_elements, fused_situ_glu, situ_glu, tanh_from_exp  # noqa: E402

BETA, LINEAR_BETA = 4.0, 25.0  # the release's activation_situ_beta / activation_situ_linear_beta

# [gate ‖ up] sizes: the default training step's shared experts, routed experts and dense MLP (batch 8 x 128), then up
# to the K3 experts' activation at 512 tokens, across where the compiled pair starts to pay.
SIZES = ((1024, 512), (4096, 256), (1024, 1536), (2048, 1024), (4096, 768), (4096, 1024), (8192, 768))
SIZES_QUICK = ((4096, 256), (4096, 1024))


def silu_and_mul(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def run(quick: bool = False, repeats: int | None = None) -> dict:
    rows = (512 if quick else 4096) * 16
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(rows, 2 * INTERMEDIATE, generator=generator) * 4).requires_grad_()
    grad_output = torch.randn(rows, INTERMEDIATE, generator=generator)
    candidates = {
        "eager situ_glu": situ_glu,
        "fused_situ_glu (model)": fused_situ_glu,
        "torch.compile(situ_glu), autograd backward": compiled_for_these_kernels(situ_glu),
        "SiLU(gate)·up (transformers)": silu_and_mul,
    }
    timed = {}
    for name, activation in candidates.items():
        timed[f"{name}|fwd"] = lambda a=activation: a(gate_up.detach(), BETA, LINEAR_BETA)
        timed[f"{name}|train"] = lambda a=activation: torch.autograd.grad(a(gate_up, BETA, LINEAR_BETA), gate_up,
                                                                          grad_output)
    repeats = repeats or 5
    seconds = time_interleaved(timed, repeats=repeats, warmup=1)
    eager = seconds["eager situ_glu|train"]
    table = [
        {
            "candidate": name,
            "fwd ms": 1e3 * seconds[f"{name}|fwd"],
            "fwd+bwd ms": 1e3 * seconds[f"{name}|train"],
            "fwd+bwd speedup vs eager": eager / seconds[f"{name}|train"],
        }
        for name in candidates
    ]
    by_size = by_activation_size(SIZES_QUICK if quick else SIZES, repeats)
    tanh_rows = tanh_candidates(repeats)
    return {
        "title": f"SiTU-GLU on [{rows:,}, {2 * INTERMEDIATE}] (fp32, K3 experts' activation)",
        "tables": [
            {"caption": "", "columns": list(table[0]), "rows": table},
            {"caption": "By activation size: eager against fused, forward+backward, and which one the model's "
                        "attachment runs on this CPU (`fused_min_elements`).",
             "columns": list(by_size[0]), "rows": by_size},
            {"caption": "tanh on [4,096, 128] (fp32): eager, and compiled by inductor as written or as the kernels "
                        "write it.", "columns": list(tanh_rows[0]), "rows": tanh_rows},
        ],
        "notes": ["fwd: on an input without grad, as in inference; fwd+bwd: with the input gradient, as in training."],
    }


def by_activation_size(sizes, repeats: int) -> list[dict]:
    """Eager against fused SiTU-GLU, forward+backward, on [gate ‖ up] of each of ``sizes``: where the compiled pair
    starts to pay on this CPU, beside which one the model's attachment runs there (`fused_min_elements`)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for height, width in sizes:
        gate_up = (torch.randn(height, width, generator=generator) * 4).requires_grad_()
        grad_output = torch.randn(height, width // 2, generator=generator)
        seconds = time_interleaved(
            {name: lambda a=activation: torch.autograd.grad(a(gate_up, BETA, LINEAR_BETA), gate_up, grad_output)
             for name, activation in (("eager", situ_glu), ("fused", fused_situ_glu))},
            repeats=repeats, warmup=1,
        )
        outputs = height * width // 2
        rows.append({
            "[gate ‖ up]": f"[{height:,}, {width}]",
            "outputs": f"{outputs:,}",
            "eager ms": 1e3 * seconds["eager"],
            "fused ms": 1e3 * seconds["fused"],
            "fused speedup": seconds["eager"] / seconds["fused"],
            "the model runs": "fused" if outputs >= fused_min_elements("cpu") else "eager",
        })
    return rows


def inductors_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def tanh_candidates(repeats: int) -> list[dict]:
    """tanh of the routed experts' up half in the default training step, each way, with its speed against eager."""
    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(2)) * 4
    candidates = {
        "torch.tanh, eager": torch.tanh,
        "torch.tanh, compiled": CompiledFunction(inductors_tanh, static_widths=True),
        "tanh_from_exp, compiled (the kernels)": CompiledFunction(tanh_from_exp, static_widths=True),
    }
    seconds = time_interleaved({name: lambda f=function: f(x) for name, function in candidates.items()},
                               repeats=repeats, warmup=1)
    eager = seconds["torch.tanh, eager"]
    return [{"tanh": name, "µs": 1e6 * seconds[name], "speed vs eager": eager / seconds[name]} for name in candidates]


def main() -> None:
    args = bench_arguments(__doc__)
    report("situ", run(args.quick, args.repeats), args.json)


if __name__ == "__main__":
    main()
