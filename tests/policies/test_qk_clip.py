"""QK-Clip: per-head logit maxima recorded at the MLA seam over real tokens in training forwards, the clip that
brings a head's max logit to tau and leaves the others bitwise, the MAX over ranks, and refused setups."""

import pytest
import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig

from kimi_k3.policies.qk_clip import QKClip
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config
from tests.test_modeling import build, causal_mask


def first_mla_layer(clip: QKClip):
    """(attention layer, its recorder) of the first MLA layer QK-Clip records."""
    return next(iter(clip.recorders.values()))


def test_qk_clip_records_per_head_logit_max_only_in_training():
    model = build()
    clip = QKClip(model, tau=float("inf"))
    clip.attach()
    attn, recorder = clip.recorders["layer_3"]
    assert attn is model.model.layers[3].self_attn and attn.query_key_observer is recorder
    x = torch.randn(2, 7, model.config.hidden_size, dtype=torch.float64)
    attn(x, attention_mask=causal_mask(7))
    assert torch.isinf(recorder.maximum).all()
    attn.train()
    attn(x, attention_mask=causal_mask(7))
    q = attn.project_queries(x)
    keys, _ = attn.expand_key_values(*attn.compress_key_values(x))
    logits = (q @ keys.transpose(2, 3)) * attn.scaling
    logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(recorder.maximum, logits.amax(dim=(0, 2, 3)))


def test_qk_clip_brings_head_max_logit_to_tau():
    config = tiny_config()
    model = KimiK3ForCausalLM(config).train()
    clip = QKClip(model, float("inf"))  # tau is set once the maxima are known
    clip.attach()  # records from here on
    tokens = torch.randint(3, config.vocab_size, (2, 16))
    attn, recorder = first_mla_layer(clip)  # the first MLA layer: same input after the clip
    with torch.no_grad():
        attn.q_b_proj.weight.view(2, 12, -1)[0] *= 4.0  # head 0 well above head 1
    model(input_ids=tokens)
    recorded = recorder.maximum.clone()
    tau = recorded[0].item() / 2  # S_0 = 2·tau
    assert recorded[1] <= tau
    weights = (attn.q_b_proj.weight, attn.kv_b_proj.weight, attn.kv_a_proj_with_mqa.weight)
    query_before, key_value_before, shared_key_before = (weight.detach().clone() for weight in weights)
    clip.tau = tau
    clip()
    assert torch.all(recorder.maximum == -torch.inf)
    model(input_ids=tokens)
    assert recorder.maximum[0].item() == pytest.approx(tau, rel=1e-3)
    assert recorder.maximum[1] == recorded[1]
    query, query_before = attn.q_b_proj.weight.detach().view(2, 12, -1), query_before.view(2, 12, -1)
    key_value, key_value_before = attn.kv_b_proj.weight.detach().view(2, 16, -1), key_value_before.view(2, 16, -1)
    assert torch.equal(query[1], query_before[1]) and torch.equal(key_value[1], key_value_before[1])
    assert torch.equal(key_value[0, 8:], key_value_before[0, 8:])  # V rows
    assert torch.equal(attn.kv_a_proj_with_mqa.weight, shared_key_before)  # shared k_r
    torch.testing.assert_close(query[0, :8], query_before[0, :8] * 0.5**0.5)  # nope: sqrt(gamma)
    torch.testing.assert_close(key_value[0, :8], key_value_before[0, :8] * 0.5**0.5)
    torch.testing.assert_close(query[0, 8:], query_before[0, 8:] * 0.5)  # rope: gamma


def test_large_query_scale_clips_its_head_to_tau_and_padded_query_rows_cannot_trigger_a_clip():
    config = tiny_config()
    model = KimiK3ForCausalLM(config).train()
    clip = QKClip(model, float("inf"))
    clip.attach()
    tokens = torch.randint(3, config.vocab_size, (2, 16))
    attention_mask = torch.ones_like(tokens)
    attention_mask[1, 12:] = 0  # right padding: the last 4 query rows of sequence 1 are never attended from
    attn, recorder = first_mla_layer(clip)
    with torch.no_grad():
        attn.q_b_proj.weight.view(2, 12, -1)[0] *= 4.0  # a deliberately large query scale on head 0

    def recorded_maxima(scale_padded_queries):
        def scale(module, inputs, output):
            output[1, 12:] *= scale_padded_queries

        recorder.maximum.fill_(-torch.inf)
        handle = attn.q_b_proj.register_forward_hook(scale)
        model(input_ids=tokens, attention_mask=attention_mask)
        handle.remove()
        return recorder.maximum.clone()

    plain = recorded_maxima(1.0)
    # Padded query rows 100x larger: a head's max covers real rows only, so it is bitwise the plain forward's.
    assert torch.equal(recorded_maxima(100.0), plain)
    tau = plain[0].item() / 2  # S_0 = 2 tau, S_1 <= tau
    assert plain[1] <= tau
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    clip.tau = tau
    clip()  # on the maxima of the forward with 100x padded query rows
    assert clip.latest_metrics["qk_clip/clipped_heads"] == 1
    assert clip.latest_metrics["qk_clip/max_logit"] == plain[0].item()
    assert clip.latest_metrics["qk_clip/max_logit_after"] == pytest.approx(tau, rel=1e-6)
    after = recorded_maxima(1.0)
    assert after[0].item() == pytest.approx(tau, rel=1e-3)
    assert after[1] == plain[1]
    query, query_before = attn.q_b_proj.weight.detach().view(2, 12, -1), before[
        f"model.layers.{config.mla_layer_indices[0]}.self_attn.q_b_proj.weight"].view(2, 12, -1)
    assert torch.equal(query[1], query_before[1]) and not torch.equal(query[0], query_before[0])
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    prefix = f"model.layers.{config.mla_layer_indices[0]}.self_attn"
    assert changed == {f"{prefix}.q_b_proj.weight", f"{prefix}.kv_b_proj.weight"}


def test_qk_clip_max_reduces_logits_over_ranks(monkeypatch):
    model = KimiK3ForCausalLM(tiny_config())
    clip = QKClip(model, tau=1.0)
    clip.attach()
    for _, recorder in clip.recorders.values():
        recorder.maximum.fill_(0.5)  # this rank: under tau
    other_rank = torch.tensor([[4.0, 0.25]] * len(clip.recorders))  # another rank: head 0 over tau

    def all_reduce(tensor, op):
        assert op == dist.ReduceOp.MAX
        torch.maximum(tensor, other_rank, out=tensor)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    query = model.model.layers[model.config.mla_layer_indices[0]].self_attn.q_b_proj.weight
    before = query.detach().clone().view(2, 12, -1)
    clip()
    after = query.detach().view(2, 12, -1)
    torch.testing.assert_close(after[0, 8:], before[0, 8:] / 4)  # gamma = tau / 4 from the other rank
    assert torch.equal(after[1], before[1])  # max(0.5, 0.25) <= tau


def test_qk_clip_refuses_a_tensor_parallel_model():
    model = KimiK3ForCausalLM(tiny_config())
    model.config.distributed_config = DistributedConfig(tp_size=2)
    with pytest.raises(ValueError, match="tensor-parallel model"):
        QKClip(model, 100.0)


@pytest.mark.parametrize("tau", [0, -1.0, float("nan"), "100"])
def test_qk_clip_refuses_a_threshold_that_is_not_a_positive_number(tau):
    model = KimiK3ForCausalLM(tiny_config())
    with pytest.raises(ValueError, match="`qk_clip_tau` must be a number > 0"):
        QKClip(model, tau)


def test_clipping_before_attaching_is_an_error_not_a_silent_no_op():
    with pytest.raises(RuntimeError, match="attach it first"):
        QKClip(KimiK3ForCausalLM(tiny_config()), 100.0)()
