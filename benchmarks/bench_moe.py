"""P1: the Stable LatentMoE block (`KimiK3SparseMoeBlock`) forward and forward+backward at K3 sparsity.

Two settings at reduced widths (hidden 1024, latent 512, expert intermediate 384, two shared experts):
"K3" = 896 experts, top-16 (the release's sparsity) and "mid" = 64 experts, top-8. Candidates, timed interleaved:

- our block with each experts implementation: grouped_mm (default), eager (the per-expert reference loop),
  batched_mm (only where its per-token weight gather fits in memory); and grouped_mm with the sorted experts'
  gathers that `kimi-k3-train` attaches (`kimi_k3.kernels.sorted_experts`), as the job trains it;
- transformers' `Qwen3MoeSparseMoeBlock` at the same expert shapes (hidden = our latent), each implementation;
- the dense ceiling: the same block with routing replaced by one dense GLU of k·I units (identical matmul FLOPs);
- experts only: `KimiK3Experts` against `Qwen3MoeExperts` on identical routing (identical FLOPs, time ratio).

Blocks do different amounts of work, so they are compared by achieved matmul GFLOP/s (forward FLOPs x 3 for
forward+backward); "vs eager" is a time ratio of the same block.

    python benchmarks/bench_moe.py            # 4096 tokens (about five minutes on two cores)
    python benchmarks/bench_moe.py --quick    # 512 tokens
"""

import gc
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, forward_backward, report, time_interleaved, zero_grads  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.kernels.fused_situ import use_fused_situ  # noqa: E402
from kimi_k3.kernels.sorted_experts import use_sorted_experts  # noqa: E402
from modeling_kimi_k3 import (  # noqa: E402
    KimiK3Experts,
    KimiK3GLUActivation,
    KimiK3MLP,
    KimiK3RMSNorm,
    KimiK3SparseMoeBlock,
)

HIDDEN, LATENT, INTERMEDIATE, SHARED = 1024, 512, 384, 2
FAST_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
# batched_mm gathers a [2I, latent] + [latent, I] weight copy per (token, expert) pair; run it only below this.
BATCHED_MM_MAX_BYTES = 4 * 2**30
# The eager loop's backward writes a full-size zero gradient per expert (O(E·|W|), independent of tokens):
# about 1.2 TB of memory traffic at 896 experts, so it is only run where that stays small.
EAGER_BACKWARD_MAX_EXPERTS = 128


@dataclass(frozen=True)
class Setting:
    name: str
    num_experts: int
    top_k: int
    tokens: int


def kimi_config(setting: Setting) -> KimiK3Config:
    return KimiK3Config(
        hidden_size=HIDDEN,
        routed_expert_hidden_size=LATENT,
        moe_intermediate_size=INTERMEDIATE,
        num_shared_experts=SHARED,
        num_experts=setting.num_experts,
        num_experts_per_token=setting.top_k,
    )


def qwen_config(setting: Setting) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=LATENT,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=setting.num_experts,
        num_experts_per_tok=setting.top_k,
        norm_topk_prob=True,
    )


def initialise(module: nn.Module) -> nn.Module:
    """Random weights (std 0.02, norms at 1): a random router spreads tokens over the experts as at init; our
    SiTU-GLU modules get the fused kernels, as in the training job."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.ndim >= 2:
                parameter.normal_(0.0, 0.02, generator=generator)
            else:
                parameter.fill_(1.0)
    use_fused_situ(module)
    return module.train()


class DenseEquivalentBlock(nn.Module):
    """The LatentMoE block with routing replaced by one dense GLU of k·I units: the same matmul FLOPs, no
    gather/scatter. Its FLOP rate is the ceiling a sparse block can approach."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        active = config.num_experts_per_token * config.moe_intermediate_size
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.routed_expert_down_proj = nn.Linear(config.hidden_size, config.routed_expert_hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(config.routed_expert_hidden_size, 2 * active, bias=False)
        self.glu = KimiK3GLUActivation(config)
        self.down_proj = nn.Linear(active, config.routed_expert_hidden_size, bias=False)
        self.routed_expert_norm = KimiK3RMSNorm(config.routed_expert_hidden_size)
        self.routed_expert_up_proj = nn.Linear(config.routed_expert_hidden_size, config.hidden_size, bias=False)
        self.shared_experts = KimiK3MLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        scores = self.gate(hidden_states).sigmoid()
        latent = self.routed_expert_down_proj(hidden_states)
        latent = self.down_proj(self.glu(*self.gate_up_proj(latent).chunk(2, dim=-1)))
        routed = self.routed_expert_up_proj(self.routed_expert_norm(latent)) * scores[..., :1]
        return routed + self.shared_experts(hidden_states)


def block_flops(setting: Setting) -> float:
    """Forward matmul FLOPs per token of our block: router, W↓, k experts (gate+up, down), W↑, shared GLU."""
    experts = setting.top_k * 6 * LATENT * INTERMEDIATE
    shared = 6 * HIDDEN * INTERMEDIATE * SHARED
    return 2 * HIDDEN * setting.num_experts + 4 * HIDDEN * LATENT + experts + shared


def qwen_block_flops(setting: Setting) -> float:
    return 2 * LATENT * setting.num_experts + setting.top_k * 6 * LATENT * INTERMEDIATE


def batched_mm_bytes(setting: Setting) -> int:
    return 4 * setting.tokens * setting.top_k * 3 * LATENT * INTERMEDIATE


def our_block(setting: Setting, implementation: str) -> KimiK3SparseMoeBlock:
    config = kimi_config(setting)
    config._experts_implementation = implementation
    return initialise(KimiK3SparseMoeBlock(config))


def block_candidates(setting: Setting, inputs: torch.Tensor, latent_inputs: torch.Tensor, implementations,
                     dense: bool, ours_as_trained: bool = False) -> dict:
    """name -> (module, forward callable, forward FLOPs, run backward?); ``ours_as_trained`` has our block only as the
    job trains it (grouped_mm with the sorted experts) beside transformers' ``implementations``."""
    candidates = {}
    for implementation in implementations:
        if implementation == "batched_mm" and batched_mm_bytes(setting) > BATCHED_MM_MAX_BYTES:
            continue
        backward = implementation != "eager" or setting.num_experts <= EAGER_BACKWARD_MAX_EXPERTS
        if not ours_as_trained:
            ours = our_block(setting, implementation)
            candidates[f"ours [{implementation}]"] = (ours, lambda m=ours: m(inputs), block_flops(setting), backward)
        qwen_cfg = qwen_config(setting)
        qwen_cfg._experts_implementation = implementation
        qwen = initialise(Qwen3MoeSparseMoeBlock(qwen_cfg))
        candidates[f"HF qwen3_moe [{implementation}]"] = (
            qwen, lambda m=qwen: m(latent_inputs), qwen_block_flops(setting), backward
        )
    if ours_as_trained:
        trained = our_block(setting, "grouped_mm")
        use_sorted_experts(trained)
        candidates["ours [grouped_mm, sorted experts]"] = (trained, lambda: trained(inputs), block_flops(setting), True)
    if dense:
        block = initialise(DenseEquivalentBlock(kimi_config(setting)))
        candidates["dense equivalent"] = (block, lambda: block(inputs), block_flops(setting), True)
    return candidates


def time_blocks(setting: Setting, repeats: int) -> list[dict]:
    """Three interleaved groups, each with only its own blocks alive: the fast backends with the dense ceiling, our
    block as trained with transformers' fast backends and the dense ceiling, then the eager loops next to the
    grouped_mm blocks they are compared with. With all six K3-size blocks (2.1 GB of expert weights each) alive at
    once, memory pressure slowed every candidate by 40-60%, unevenly; a third K3-size block in the first group slowed
    it by about as much."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(1, setting.tokens, HIDDEN, generator=generator).requires_grad_()
    latent_inputs = torch.randn(1, setting.tokens, LATENT, generator=generator).requires_grad_()
    fast = []
    for ours_as_trained in (False, True):
        group = block_candidates(setting, inputs, latent_inputs, FAST_IMPLEMENTATIONS, dense=True,
                                 ours_as_trained=ours_as_trained)
        group = _time_group(setting, group, repeats, inputs, latent_inputs)
        _add_rate_ratios(group)
        if ours_as_trained:
            for row in group:
                if not row["candidate"].startswith("ours"):
                    row["candidate"] += " (trained group)"
        fast += group
    loops = block_candidates(setting, inputs, latent_inputs, ("eager", "grouped_mm"), dense=True)
    loops = _time_group(setting, loops, repeats, inputs, latent_inputs)
    _add_eager_ratios(loops)
    return fast + loops


def _time_group(setting: Setting, candidates: dict, repeats: int, *inputs) -> list[dict]:
    timed = {}
    for name, (module, forward, _, backward) in candidates.items():
        timed[f"{name}|fwd"] = _no_grad(forward)
        if backward:
            timed[f"{name}|train"] = _step_and_clear(forward, module, *inputs)
    times = time_interleaved(timed, repeats=repeats, warmup=1)
    rows = []
    for name, (_, _, flops, _) in candidates.items():
        forward_s, train_s = times[f"{name}|fwd"], times.get(f"{name}|train")
        rows.append(
            {
                "setting": setting.name,
                "candidate": name,
                "fwd ms": 1e3 * forward_s,
                "fwd GFLOP/s": flops * setting.tokens / forward_s / 1e9,
                "fwd+bwd ms": 1e3 * train_s if train_s else None,
                "fwd+bwd GFLOP/s": 3 * flops * setting.tokens / train_s / 1e9 if train_s else None,
            }
        )
    candidates.clear()
    gc.collect()  # free this group's blocks before the next group is built
    return rows


def _add_rate_ratios(rows: list[dict]) -> None:
    """vs best HF and % of dense: achieved FLOP-rate ratios within the fast group."""
    dense = next(row for row in rows if row["candidate"] == "dense equivalent")
    for phase, rate in (("fwd", "fwd GFLOP/s"), ("fwd+bwd", "fwd+bwd GFLOP/s")):
        best_hf = max(row[rate] for row in rows if row["candidate"].startswith("HF"))
        for row in rows:
            if row["candidate"] != "dense equivalent":
                row[f"{phase} vs best HF"] = row[rate] / best_hf
            row[f"{phase} % dense"] = 100 * row[rate] / dense[rate]


def _add_eager_ratios(loops: list[dict]) -> None:
    """vs eager: time ratio of each family's grouped_mm block to its eager loop, both from the eager group; the rows
    of that group are marked so their times are not mistaken for the fast group's."""
    timed = {row["candidate"]: row for row in loops}
    for row in loops:
        family = row["candidate"].split(" [")[0]
        eager = timed.get(f"{family} [eager]")
        if row["candidate"] == f"{family} [grouped_mm]" and eager is not None:
            for phase in ("fwd", "fwd+bwd"):
                if eager[f"{phase} ms"] and row[f"{phase} ms"]:
                    row[f"{phase} vs eager"] = eager[f"{phase} ms"] / row[f"{phase} ms"]
    for row in loops:
        if "[eager]" not in row["candidate"]:
            row["candidate"] += " (eager group)"


def _no_grad(forward):
    def run():
        with torch.no_grad():
            forward()

    return run


def _step_and_clear(forward, module, *inputs):
    step = forward_backward(forward)

    def run():
        step()
        zero_grads(module, *inputs)

    return run


def eager_backward_floor(setting: Setting) -> float:
    """Seconds the eager loop's backward spends on gradient bookkeeping alone: for every routed expert, autograd
    writes a full-size zero gradient of both 3-D expert parameters and adds it into the accumulated one."""
    shapes = [(setting.num_experts, 2 * INTERMEDIATE, LATENT), (setting.num_experts, LATENT, INTERMEDIATE)]
    accumulated = [torch.zeros(shape) for shape in shapes]

    def one_expert():
        for gradient in accumulated:
            gradient.add_(torch.zeros(gradient.shape))

    return setting.num_experts * time_interleaved({"one expert": one_expert}, repeats=2)["one expert"]


def time_experts_only(setting: Setting, repeats: int) -> list[dict]:
    """KimiK3Experts vs Qwen3MoeExperts on the same balanced random routing: identical matmul FLOPs.

    Ours is also run with SiLU in place of SiTU-GLU, which isolates the cost of K3's activation (K3 report §2.3.2 Eq. 12).
    """
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randn(setting.tokens, LATENT, generator=generator).requires_grad_()
    scores = torch.rand(setting.tokens, setting.num_experts, generator=generator)
    weights, indices = scores.topk(setting.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    flops = setting.top_k * 6 * LATENT * INTERMEDIATE * setting.tokens
    config, qwen_cfg = kimi_config(setting), qwen_config(setting)
    silu_config = KimiK3Config(**{**config.to_dict(), "hidden_act": "silu"})
    for each in (config, qwen_cfg, silu_config):
        each._experts_implementation = "grouped_mm"
    timed = {}
    experts_under_test = (
        ("ours", KimiK3Experts(config)),
        ("ours with SiLU instead of SiTU", KimiK3Experts(silu_config)),
        ("HF qwen3_moe", Qwen3MoeExperts(qwen_cfg)),
    )
    for family, experts in experts_under_test:
        experts = initialise(experts)
        timed[f"{family} experts [grouped_mm]"] = _step_and_clear(
            lambda e=experts: e(tokens, indices, weights), experts, tokens
        )
    times = time_interleaved(timed, repeats=repeats, warmup=1)
    hf = times["HF qwen3_moe experts [grouped_mm]"]
    return [
        {
            "setting": setting.name,
            "candidate": name,
            "fwd+bwd ms": 1e3 * seconds,
            "fwd+bwd GFLOP/s": 3 * flops / seconds / 1e9,
            "speedup vs HF": hf / seconds,
        }
        for name, seconds in times.items()
    ]


def _eager_floor_note(setting: Setting, rows: list[dict]) -> str:
    by_name = {row["candidate"]: row for row in rows}
    floor_ms = by_name["ours [eager]"]["fwd ms"] + 1e3 * eager_backward_floor(setting)
    grouped_ms = by_name["ours [grouped_mm] (eager group)"]["fwd+bwd ms"]
    return (
        f"{setting.name}: eager forward+backward not run; its forward plus {setting.num_experts} full-size zero "
        f"gradients already take >= {floor_ms / 1e3:.0f} s, so grouped_mm is >= {floor_ms / grouped_ms:.0f}x faster."
    )


def _eager_ceiling_note(setting: Setting, rows: list[dict]) -> str:
    """Where the eager loop is itself efficient, no block can be much faster: bound the ">= 3x eager" target."""
    by_name = {row["candidate"]: row for row in rows}
    eager_ms = by_name["ours [eager]"]["fwd+bwd ms"]
    return (
        f"{setting.name}: even at the dense-equivalent time (same FLOPs, no routing) a block would be only "
        f"{eager_ms / by_name['dense equivalent (eager group)']['fwd+bwd ms']:.2f}x the eager loop (fwd+bwd); "
        f"grouped_mm is {by_name['ours [grouped_mm] (eager group)']['fwd+bwd vs eager']:.2f}x."
    )


def run(quick: bool = False, repeats: int | None = None) -> dict:
    tokens = 512 if quick else 4096
    settings = [Setting("K3 896e top-16", 896, 16, tokens), Setting("mid 64e top-8", 64, 8, tokens)]
    repeats = repeats or 2
    blocks, experts = [], []
    notes = []
    for setting in settings:
        rows = time_blocks(setting, repeats)
        if setting.num_experts > EAGER_BACKWARD_MAX_EXPERTS:
            notes.append(_eager_floor_note(setting, rows))
        else:
            notes.append(_eager_ceiling_note(setting, rows))
        blocks += rows
        experts += time_experts_only(setting, repeats)
    block_columns = [
        "setting", "candidate", "fwd ms", "fwd GFLOP/s", "fwd vs eager", "fwd+bwd ms", "fwd+bwd GFLOP/s",
        "fwd+bwd vs eager", "fwd+bwd vs best HF", "fwd+bwd % dense",
    ]
    return {
        "title": f"P1 - Stable LatentMoE block (hidden {HIDDEN}, latent {LATENT}, expert {INTERMEDIATE}, "
        f"{tokens} tokens, fp32, training mode)",
        "tables": [
            {
                "caption": "Whole blocks. Forward under no_grad; forward+backward adds a mean-square loss backward. "
                "\"vs best HF\" and \"% dense\" are FLOP-rate ratios within the first group, and for our block "
                "as trained (grouped_mm with the sorted experts) within the trained group (our block does more matmul "
                "work: latent projections and shared experts); \"vs eager\" is a time ratio within the eager group.",
                "columns": block_columns,
                "rows": blocks,
            },
            {
                "caption": "Experts only, identical routing and FLOPs (time ratio against transformers); the SiLU row "
                "shows what SiTU-GLU costs over SiLU.",
                "columns": list(experts[0]),
                "rows": experts,
            },
        ],
        "notes": notes + [
            "HF qwen3_moe runs its experts at hidden = our latent width, so its expert FLOPs equal ours; it has no "
            "latent projections or shared experts, hence the comparison by FLOP rate.",
            f"batched_mm is skipped where its per-token weight gather exceeds {BATCHED_MM_MAX_BYTES / 2**30:.0f} GiB "
            f"(it needs {batched_mm_bytes(settings[1]) / 2**30:.0f} GiB at the mid setting).",
            f"eager forward+backward is skipped above {EAGER_BACKWARD_MAX_EXPERTS} experts: its per-expert "
            "full-size zero gradients cost O(E·|W|) regardless of tokens.",
            "Targets: >= 3x eager, >= 1x the best transformers backend, >= 50% of the dense FLOP rate.",
        ],
    }


def main() -> None:
    args = bench_arguments(__doc__)
    report("moe", run(args.quick, args.repeats), args.json)


if __name__ == "__main__":
    main()
