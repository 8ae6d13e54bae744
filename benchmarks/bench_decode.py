"""P3: decoding the default `KimiK3Config()` model with its cache against recomputing the whole prefix per token.

With the cache each new token costs one step: KDA layers update a fixed d x d state per head, MLA layers attend over
the cached latent (normed c_kv and the shared k_r, DeepSeek-V2's MLA cache) in the absorbed form. Without it every token
re-runs the full forward over the prefix. Cache bytes are read off the cache itself after prefills of two lengths:
the growth per token is the MLA latent, the rest (KDA states, short-conv windows) is constant per sequence.

    python benchmarks/bench_decode.py [--quick]
"""

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, report, time_interleaved  # noqa: E402
import torch  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from modeling_kimi_k3 import CACHE_FIELD, KimiK3ForCausalLM  # noqa: E402

FULL_CONTEXTS = (128, 512, 2048)
QUICK_CONTEXTS = (128, 512)
NEW_TOKENS = 8


def cache_bytes(cache) -> int:
    """Bytes of every tensor the cache holds (attention keys/values, recurrent and conv states)."""
    return sum(_tensor_bytes(value) for layer in cache.layers for value in vars(layer).values())


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    return 0


def prefill(model: KimiK3ForCausalLM, input_ids: torch.Tensor):
    with torch.no_grad():
        return getattr(model(input_ids=input_ids, use_cache=True, logits_to_keep=1), CACHE_FIELD)


def decode_case(model: KimiK3ForCausalLM, context: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(context)
    input_ids = torch.randint(3, model.config.vocab_size, (1, context + NEW_TOKENS), generator=generator)
    prefilled = prefill(model, input_ids[:, :context])

    def with_cache():
        cache = copy.deepcopy(prefilled)  # decoding mutates the cache; the copy is < 1% of a step
        for position in range(context, context + NEW_TOKENS):
            model(input_ids=input_ids[:, position : position + 1], cache=cache, use_cache=True)

    def recompute():
        model(input_ids=input_ids[:, : context + 1], use_cache=False, logits_to_keep=1)

    with torch.no_grad():
        times = time_interleaved({"cache": with_cache, "recompute": recompute}, repeats=repeats)
    cached_tokens_per_s = NEW_TOKENS / times["cache"]
    recompute_tokens_per_s = 1 / times["recompute"]
    return {
        "context": context,
        "cached step ms": 1e3 / cached_tokens_per_s,
        "cached tok/s": cached_tokens_per_s,
        "recompute tok/s": recompute_tokens_per_s,
        "speedup": cached_tokens_per_s / recompute_tokens_per_s,
        "cache KiB": cache_bytes(prefilled) / 2**10,
    }


def cache_layout(model: KimiK3ForCausalLM, short: int, long: int) -> dict:
    """Per-token growth and constant part of the cache, from two prefill lengths; MLA expanded K/V for contrast."""
    config = model.config
    input_ids = torch.randint(3, config.vocab_size, (1, long))
    short_bytes = cache_bytes(prefill(model, input_ids[:, :short]))
    long_bytes = cache_bytes(prefill(model, input_ids))
    per_token = (long_bytes - short_bytes) / (long - short)
    num_mla = config.layer_types.count("full_attention")
    head_width = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    expanded = num_mla * config.num_attention_heads * head_width
    return {
        "cache bytes per token (MLA latent)": per_token,
        "cache bytes per sequence (KDA state + conv windows)": short_bytes - per_token * short,
        "expanded MLA K/V bytes per token (not cached)": 4 * expanded,
        "MLA layers": num_mla,
        "KDA layers": config.layer_types.count("linear_attention"),
    }


def run(quick: bool = False, repeats: int | None = None) -> dict:
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3Config()).eval()
    contexts = QUICK_CONTEXTS if quick else FULL_CONTEXTS
    rows = [decode_case(model, context, repeats or 3) for context in contexts]
    layout = cache_layout(model, contexts[0], contexts[-1])
    return {
        "title": "P3 - decode with cache vs recompute without cache (default KimiK3Config(), batch 1, fp32)",
        "tables": [
            {
                "caption": f"{NEW_TOKENS} new tokens per timed run; recompute = one full forward over context + 1.",
                "columns": list(rows[0]),
                "rows": rows,
            },
            {"caption": "Cache layout", "columns": ["quantity", "value"],
             "rows": [{"quantity": key, "value": value} for key, value in layout.items()]},
        ],
        "notes": ["The cached step time may grow only through the MLA layers' attention over the latent."],
    }


def main() -> None:
    args = bench_arguments(__doc__)
    report("decode", run(args.quick, args.repeats), args.json)


if __name__ == "__main__":
    main()
