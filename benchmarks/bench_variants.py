"""The opt-in Stable LatentMoE variants against the release default: parameters, forward FLOPs, training-step time.

Every variant is the default `KimiK3Config()` (64 experts, top-4, 8 MoE layers) with one variant switched on, at the
training job's batch (8 x 128 tokens). A step is what the job's model does per optimizer step besides the optimizer:
forward + causal-LM loss + backward with the Quantile Balancing hooks attached, then the balancing update (which
also refits a quantile router's score CDF). Candidates run interleaved in one process (min of the repetitions).

FLOPs are the matmul FLOPs of one forward per token, counted from the shapes: the whole model for the release, and
what each variant adds or removes (a shared basis's materialisation of every expert, 2·E·M·P per layer and forward,
is spread over the batch's tokens).

    python benchmarks/bench_variants.py            # 8 x 128 tokens, 3 repetitions
    python benchmarks/bench_variants.py --quick    # 2 x 64 tokens
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, report, time_interleaved  # noqa: E402
import torch  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.policies.quantile_balancing import QuantileBalancing  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402
from variants_kimi_k3 import causal_lm_class  # noqa: E402

# The configurations of docs/variants.md (default model: 64 experts, top-4).
VARIANTS = {
    "release default": {},
    "shared-basis experts (M = 16)": {"expert_basis_size": 16},
    "quantile-normalized routing (B = 64)": {"router_score_normalization": "quantile"},
    "routing-modulated attention gates": {"attention_gate_routing": True},
    "two-level routing (G = 8, g = 2)": {"num_coarse_experts": 8, "coarse_experts_per_token": 2},
    "dynamic k (k in [1, 8])": {"dynamic_experts_per_token": True},
}
BASELINE = "release default"


def moe_forward_flops_per_token(config: KimiK3Config, tokens: int) -> float:
    """Matmul FLOPs per token of one forward through the MoE layers' routers, experts and gates, and of the rest."""
    hidden, experts, k = config.hidden_size, config.num_experts, config.num_experts_per_token
    latent, intermediate = config.routed_expert_hidden_size or hidden, config.moe_intermediate_size
    expert_size = 3 * latent * intermediate
    moe_layers = config.mlp_layer_types.count("sparse")
    routed_mla = sum(1 for i in config.mla_layer_indices if config.is_moe_layer(i))
    per_layer = 2 * hidden * experts + 2 * k * expert_size
    if config.expert_basis_size is not None:
        per_layer += 2 * experts * config.expert_basis_size * expert_size / tokens
    if config.num_coarse_experts is not None:
        per_layer += 2 * hidden * config.num_coarse_experts
    total = moe_layers * per_layer
    if config.attention_gate_routing:
        total += routed_mla * (2 * hidden * experts + 2 * experts * config.num_attention_heads)
    return total


def dense_forward_flops_per_token(model: KimiK3ForCausalLM) -> float:
    """2 FLOPs per parameter of every matrix a token passes through, except the routed experts and routers."""
    skipped = ("experts.", ".gate.", "embed_tokens", "routing_weight")
    return sum(2 * p.numel() for name, p in model.named_parameters() if p.ndim == 2 and not any(s in name for s in skipped))


def training_step(model: KimiK3ForCausalLM, balancing: QuantileBalancing, ids: torch.Tensor):
    def step() -> None:
        model(ids, labels=ids).loss.backward()
        balancing.update()
        for p in model.parameters():
            p.grad = None

    return step


def main() -> None:
    args = bench_arguments(__doc__)
    batch, length = (2, 64) if args.quick else (8, 128)
    repeats = args.repeats or (1 if args.quick else 3)
    ids = torch.randint(3, 4096, (batch, length), generator=torch.Generator().manual_seed(0))
    rows, steps = [], {}
    for name, fields in VARIANTS.items():
        torch.manual_seed(0)
        config = KimiK3Config(**fields)
        model = causal_lm_class(config)(config).train()
        balancing = QuantileBalancing(model, per_layer_metrics=False)
        balancing.attach()
        steps[name] = training_step(model, balancing, ids)
        moe = moe_forward_flops_per_token(model.config, ids.numel())
        rows.append({"variant": name, "parameters": model.num_parameters(),
                     "forward MFLOP/token": (moe + dense_forward_flops_per_token(model)) / 1e6})
    times = time_interleaved(steps, repeats=repeats)
    for row in rows:
        row["step ms"] = times[row["variant"]] * 1e3
        row["vs release"] = times[row["variant"]] / times[BASELINE]
        baseline = next(r for r in rows if r["variant"] == BASELINE)
        row["parameters vs release"] = row["parameters"] / baseline["parameters"]
    report("variants", {
        "title": "Stable LatentMoE variants vs the release default (default config, forward + loss + backward + "
                 f"balancing update, {batch} x {length} tokens)",
        "tables": [{"rows": rows, "columns": ["variant", "parameters", "parameters vs release",
                                              "forward MFLOP/token", "step ms", "vs release"]}],
        "notes": ["Optimizer excluded: it scales with the parameter count (Per-Head Muon's Newton-Schulz with the "
                  "matrix shapes), measured for the release in bench_optimizer.py.",
                  "Dynamic k costs its mean count of experts, k once Quantile Balancing has set the biases; a fresh "
                  "model (biases 0) fires every expert above zero, clamped to k_max, as in this measurement's first "
                  "steps."],
    }, args.json)


if __name__ == "__main__":
    main()
