"""P5: the cost of recording Quantile Balancing statistics on the router, as a share of the MoE block forward.

In training forwards (train mode, grad enabled) the ``RouterStatistics`` hook that ``QuantileBalancing.attach``
puts on a router counts each valid token's experts and adds its required bias r = α − s to the [n, B] histogram
(K3 report App. D). The baseline is the same router without the hook; "counts only" is the hook of the sign and
"none" rules. The overhead is (router with hook − router without) / MoE block forward, all timed interleaved in one
run.

    python benchmarks/bench_router.py [--quick]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, report, time_interleaved  # noqa: E402
from benchmarks.bench_moe import HIDDEN, INTERMEDIATE, LATENT, SHARED, initialise  # noqa: E402
import torch  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.policies.quantile_balancing import RouterStatistics  # noqa: E402
from modeling_kimi_k3 import KimiK3SparseMoeBlock, KimiK3TopkRouter  # noqa: E402

PADDING_FRACTION = 0.1


def configs(quick: bool) -> list[tuple[str, KimiK3Config, int]]:
    """(name, config, tokens): the default model's MoE layer and the P1 K3-sparsity block."""
    k3 = KimiK3Config(
        hidden_size=HIDDEN,
        routed_expert_hidden_size=LATENT,
        moe_intermediate_size=INTERMEDIATE,
        num_shared_experts=SHARED,
        num_experts=896,
        num_experts_per_token=16,
    )
    return [
        ("default KimiK3Config()", KimiK3Config(), 2048 if quick else 8192),
        ("K3 896e top-16 (P1 widths)", k3, 512 if quick else 2048),
    ]


class FixedPadding:
    """Stands in for the decoder stack's PaddingTracker: the router is called directly here."""

    def __init__(self):
        self.token_mask = None

    def rows(self, num_rows: int) -> torch.Tensor | None:
        return self.token_mask


def router_variants(config: KimiK3Config, block: KimiK3SparseMoeBlock, padding: FixedPadding) -> dict:
    """The block's own router with the QB hook, and copies with the counts-only hook and with no hook."""
    routers = {"qb": block.gate.train()}
    for name in ("none", "plain"):
        routers[name] = KimiK3TopkRouter(config).train()
        routers[name].load_state_dict(block.gate.state_dict())
    for name, estimator in (("qb", "histogram"), ("none", None)):
        routers[name].register_forward_hook(RouterStatistics(routers[name], padding, estimator, num_bins=1000).record)
    return routers


def measure(name: str, config: KimiK3Config, tokens: int, repeats: int) -> list[dict]:
    config._experts_implementation = "grouped_mm"
    block = initialise(KimiK3SparseMoeBlock(config))
    padding = FixedPadding()
    routers = router_variants(config, block, padding)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, config.hidden_size, generator=generator)
    flat = hidden.view(tokens, -1)
    token_mask = torch.rand(tokens, generator=generator) >= PADDING_FRACTION

    def padded_router():
        padding.token_mask = token_mask
        routers["qb"](flat)
        padding.token_mask = None

    candidates = {
        "block forward (QB)": lambda: block(hidden),
        "router plain top-k (no hook)": lambda: routers["plain"](flat),
        "router counts only": lambda: routers["none"](flat),
        "router QB": lambda: routers["qb"](flat),
        "router QB, 10% padding": padded_router,
    }
    times = time_interleaved(candidates, repeats=repeats)
    block_s, plain_s = times["block forward (QB)"], times["router plain top-k (no hook)"]
    rows = []
    for candidate, seconds in times.items():
        row = {"config": name, "tokens": tokens, "candidate": candidate, "ms": 1e3 * seconds}
        if candidate.startswith("router") and candidate != "router plain top-k (no hook)":
            row["overhead % of block fwd"] = 100 * (seconds - plain_s) / block_s
        rows.append(row)
    return rows


def run(quick: bool = False, repeats: int | None = None) -> dict:
    repeats = repeats or 5
    rows = []
    with torch.enable_grad():
        for name, config, tokens in configs(quick):
            rows += measure(name, config, tokens, repeats)
    return {
        "title": "P5 - Quantile Balancing statistics: router overhead (training mode, grad enabled, fp32)",
        "tables": [{"caption": "", "columns": list(rows[0] | {"overhead % of block fwd": None}), "rows": rows}],
        "notes": ["Target: QB overhead <= 5% of the MoE block forward."],
    }


def main() -> None:
    args = bench_arguments(__doc__)
    report("router", run(args.quick, args.repeats), args.json)


if __name__ == "__main__":
    main()
