"""The model actually takes its fast paths, and they equal the slow references inside the model.

Kernel-level equalities (sub-chunked `chunk_kda` ≡ `recurrent_kda` ≡ a naive loop) live in tests/test_kda.py; here the
KDA layer is pinned end to end: its chunked prefill, with the gate lower bound it passes to the kernel, against
token-by-token decoding through the cache, which runs the plain recurrence.
"""

import torch
from transformers.cache_utils import DynamicCache

import modeling_kimi_k3
from modeling_kimi_k3 import KimiK3DeltaAttention, kda_sub_chunk_size
from tests.conftest import tiny_config


def kda_layer(dtype=torch.float64) -> tuple[KimiK3DeltaAttention, object]:
    """A KDA layer of the tiny config (gate_lower_bound −5) with O(1) random weights."""
    config = tiny_config()
    layer = KimiK3DeltaAttention(config, layer_idx=config.layer_types.index("linear_attention")).to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=dtype) * 0.5)
    return layer, config


def test_kda_layer_prefill_equals_token_by_token_recurrence_fp64():
    """Chunked prefill (sub-chunked scores, 3 chunks of 64) ≡ 150 cached decode steps of `recurrent_kda`."""
    layer, config = kda_layer()
    hidden = torch.randn(2, 150, config.hidden_size, dtype=torch.float64)
    prefill, _ = layer(hidden)
    cache = DynamicCache(config=config)
    steps = [layer(hidden[:, t : t + 1], past_key_values=cache)[0] for t in range(hidden.shape[1])]
    assert (torch.cat(steps, dim=1) - prefill).abs().max() <= 1e-10


def test_kda_layer_runs_the_sub_chunked_kernel_with_its_lower_bound(monkeypatch):
    """The layer hands its gate_lower_bound to `chunk_kda`: fp32 prefill uses 16-step sub-chunks, not the S = 1 form."""
    layer, config = kda_layer(dtype=torch.float32)
    used = []
    scores = modeling_kimi_k3.kda_intra_chunk_scores

    def recording_scores(q, k, gamma, sub_chunk_size):
        used.append(sub_chunk_size)
        return scores(q, k, gamma, sub_chunk_size)

    monkeypatch.setattr(modeling_kimi_k3, "kda_intra_chunk_scores", recording_scores)
    layer(torch.randn(1, 70, config.hidden_size))
    assert used == [kda_sub_chunk_size(64, -5.0, torch.float32)] == [16]
