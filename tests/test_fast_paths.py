"""The model actually takes its fast paths, they equal the slow references inside the model, and training never waits
for the device in model code.

Kernel-level equalities (sub-chunked `chunk_kda` ≡ `recurrent_kda` ≡ a naive loop) live in tests/test_kda.py; here the
KDA layer is pinned end to end: its chunked prefill, with the gate lower bound it passes to the kernel, against
token-by-token decoding through the cache, which runs the plain recurrence. The fused SiTU-GLU kernels attached from
outside are pinned to the model's reference in tests/test_kernels/test_fused_situ.py.
"""

import os
import traceback

import pytest
import torch
from transformers.cache_utils import DynamicCache
from torch.utils._python_dispatch import TorchDispatchMode

import kda_kimi_k3
import modeling_kimi_k3
from kda_kimi_k3 import kda_sub_chunk_size
from kimi_k3.policies.qk_clip import QKClip
from kimi_k3.policies.quantile_balancing import QuantileBalancing, RouterStatistics
from modeling_kimi_k3 import KimiK3DeltaAttention
from tests.conftest import seeded_generator, tiny_config

pytestmark = pytest.mark.device  # runs on KIMI_K3_TEST_DEVICE (tests/conftest.py)

aten = torch.ops.aten


def kda_layer(dtype=torch.float64) -> tuple[KimiK3DeltaAttention, object]:
    """A KDA layer of the tiny config (gate_lower_bound −5) with O(1) random weights."""
    config = tiny_config()
    layer = KimiK3DeltaAttention(config, layer_idx=config.layer_types.index("linear_attention")).to(dtype)
    generator = seeded_generator(0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=dtype) * 0.5)
    return layer, config


def test_kda_layer_prefill_equals_token_by_token_recurrence_fp64():
    """Chunked prefill (sub-chunked scores, a partial last chunk) ≡ 150 cached decode steps of `recurrent_kda`."""
    layer, config = kda_layer()
    hidden = torch.randn(2, 150, config.hidden_size, dtype=torch.float64)
    prefill, _ = layer(hidden)
    cache = DynamicCache(config=config)
    steps = [layer(hidden[:, t : t + 1], cache=cache)[0] for t in range(hidden.shape[1])]
    assert (torch.cat(steps, dim=1) - prefill).abs().max() <= 1e-10


def test_kda_layer_runs_the_sub_chunked_kernel_with_its_lower_bound(monkeypatch):
    """The layer hands its gate_lower_bound to `chunk_kda`: fp32 prefill uses 16-step sub-chunks, not the S = 1 form."""
    layer, config = kda_layer(dtype=torch.float32)
    used = []
    scores = kda_kimi_k3.kda_intra_chunk_scores

    def recording_scores(q, k, gamma, sub_chunk_size):
        used.append(sub_chunk_size)
        return scores(q, k, gamma, sub_chunk_size)

    monkeypatch.setattr(kda_kimi_k3, "kda_intra_chunk_scores", recording_scores)
    layer(torch.randn(1, 70, config.hidden_size))
    assert used == [kda_sub_chunk_size(64, -5.0, torch.float32)] == [16]


class CopyRecorder(TorchDispatchMode):
    """Counts the ops that copy a tensor's elements into new memory."""

    COPIES = {aten.clone, aten.copy_, aten.constant_pad_nd, aten._to_copy}

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func.overloadpacket in self.COPIES
        return func(*args, **(kwargs or {}))


def test_chunked_kda_copies_each_input_once_into_chunk_order():
    """q, k, v, g and β are each copied (padded where the length needs it) once into contiguous [B, H, N, C, ...]
    chunks; every product after that reads its operands in place (strided chunks made each product copy first)."""
    for seq_len in (128, 77):  # whole chunks, a padded tail
        q, k, v, g, beta = (torch.rand(2, seq_len, 3, *tail) for tail in ((16,), (16,), (8,), (16,), ()))
        with CopyRecorder() as recorder:
            kda_kimi_k3.chunk_kda(q, k, v, -g, beta, chunk_size=32, gate_lower_bound=-5.0)
        assert recorder.copies == 5, seq_len


# ------------------------------------------------------------------------------------------------ host synchronisation
class HostSyncRecorder(TorchDispatchMode):
    """Records ops whose result the host must read back (on a GPU, a wait for the device): `.item()`, `bool()`,
    `int()` (``_local_scalar_dense``), ``torch.equal``, outputs sized by the data (``nonzero``, ``masked_select``,
    ``bincount``, ``unique``, ...) and boolean-mask indexing or assignment, each with the line that issued it. Ops
    issued inside transformers are left out: its mask helpers check whether a padding mask is all ones, outside this
    project's code. Device-to-host copies are invisible on a CPU-only machine."""

    DATA_DEPENDENT = {
        aten._local_scalar_dense, aten.equal, aten.nonzero, aten.masked_select, aten.bincount, aten._unique2,
        aten.unique_consecutive, aten.unique_dim, aten.repeat_interleave,
    }
    INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indices = args[1] if func.overloadpacket in self.INDEXING else ()
        boolean_index = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        if func.overloadpacket in self.DATA_DEPENDENT or boolean_index:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if f"{os.sep}torch{os.sep}" not in f.filename)
            if f"{os.sep}transformers{os.sep}" not in caller.filename:
                self.syncs.append(f"{func} at {os.path.basename(caller.filename)}:{caller.lineno} ({caller.name})")
        return func(*args, **(kwargs or {}))


def training_step_syncs(model) -> list[str]:
    """Host syncs of model code in one forward+backward with padding (``inputs_embeds`` stands in for ``input_ids``,
    whose range check reads values for CPU inputs only, by design)."""
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    embeds = model.get_input_embeddings()(ids)
    with HostSyncRecorder() as recorder:
        model(inputs_embeds=embeds, attention_mask=mask, labels=ids).loss.backward()
    return recorder.syncs


def test_training_step_never_waits_for_the_device_in_model_code():
    """Padding, QB statistics, QK-Clip recording, both attention types, experts and loss: no host-synchronising op."""
    model = modeling_kimi_k3.KimiK3ForCausalLM(tiny_config()).train()
    balancing, clip = QuantileBalancing(model), QKClip(model, tau=100.0)
    balancing.attach(), clip.attach()
    assert training_step_syncs(model) == []
    statistics = balancing.statistics.values()
    assert all(stats.tokens_per_expert.sum() == 35 * stats.router.top_k for stats in statistics)  # valid tokens only
    assert all(torch.isfinite(recorder.maximum).all() for _, recorder in clip.recorders.values())


def test_the_sync_recorder_catches_boolean_mask_indexing(monkeypatch):
    """The recorder is not blind: the boolean-mask filtering that `masked_counts` replaced is reported."""

    def add_with_boolean_mask(self, router, tokens, logits, weights, routes):
        token_mask = self.padding.rows(routes.shape[0])
        self.tokens_per_expert += torch.bincount(routes[token_mask].reshape(-1), minlength=router.num_experts)

    monkeypatch.setattr(RouterStatistics, "_add", add_with_boolean_mask)
    model = modeling_kimi_k3.KimiK3ForCausalLM(tiny_config()).train()
    QuantileBalancing(model).attach()
    syncs = training_step_syncs(model)
    assert any("aten.index" in sync for sync in syncs) and any("bincount" in sync for sync in syncs)
