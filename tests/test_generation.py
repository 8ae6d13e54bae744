"""Cached generation: the hybrid KDA/MLA cache reproduces full forwards; bad generation inputs fail clearly."""

import warnings

import pytest
import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from modeling_kimi_k3 import CACHE_FIELD, KimiK3ForCausalLM
from tests.conftest import seeded_generator, tiny_config
from tests.numerics import assert_as_accurate, float64_copy

pytestmark = pytest.mark.device  # runs on KIMI_K3_TEST_DEVICE (tests/conftest.py)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config(pad_token_id=0, eos_token_id=None)).eval()
    with torch.no_grad():  # non-uniform AttnRes mixes
        for name, param in model.named_parameters():
            if "res_proj" in name:
                param.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def exact_model(model):
    return float64_copy(model)


def left_padded_prompts(lengths, vocab=97, pad=0):
    generator = seeded_generator(1)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def greedy_without_cache(model, ids, mask, new_tokens):
    for _ in range(new_tokens):
        logits = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


def test_greedy_generate_with_cache_equals_repeated_full_forwards(model):
    ids, mask = left_padded_prompts([11, 4, 7])
    with torch.no_grad():
        generated = model.generate(
            ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        reference = greedy_without_cache(model, ids, mask, 40)
    assert generated.shape == (3, 11 + 40)
    assert torch.equal(generated, reference)


def test_generate_without_cache_matches_cached(model):
    ids, mask = left_padded_prompts([6, 9])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_a_model_of_kda_layers_alone_generates_by_full_forwards_and_refuses_a_cache_in_one_line():
    kda_only = ["linear_attention"] * 9
    model = KimiK3ForCausalLM(tiny_config(layer_types=kda_only, use_cache=False, pad_token_id=0,
                                          eos_token_id=None)).eval()
    ids, mask = left_padded_prompts([6, 9])
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(generated, greedy_without_cache(model, ids, mask, 8))
        with pytest.raises(ValueError, match=r"^This model has no MLA layer .* call it with `use_cache=False`"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, use_cache=True)


ASSISTED_DECODING = {
    "prompt lookup of 1 token": dict(prompt_lookup_num_tokens=1),
    "prompt lookup of 3 tokens": dict(prompt_lookup_num_tokens=3),
    "a draft model": dict(assistant_model="draft"),
    "a generation config asking for prompt lookup": dict(generation_config=GenerationConfig(
        prompt_lookup_num_tokens=2, do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None)),
}


@pytest.mark.parametrize("request_", ASSISTED_DECODING.values(), ids=ASSISTED_DECODING)
def test_assisted_decoding_is_refused_in_one_line_under_every_transformers(model, request_):
    """transformers 5.25 would roll the KDA state back to a wrong one and decode other tokens than greedy decoding;
    earlier releases refuse stateful models themselves. Either way the model refuses first, with one message."""
    if request_.get("assistant_model") == "draft":
        request_ = {"assistant_model": KimiK3ForCausalLM(tiny_config(pad_token_id=0, eos_token_id=None)).eval()}
    # One row (transformers drafts for one sequence only) whose n-grams repeat, so prompt lookup has drafts to verify:
    # without the refusal, 5.25 decodes other tokens than greedy at 1 drafted token and fails in its cache at 3.
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    if "generation_config" in request_:
        kwargs = {}
    with torch.no_grad(), pytest.raises(ValueError) as refusal:
        model.generate(ids, **kwargs, **request_)
    assert str(refusal.value).startswith("Kimi K3 does not support assisted decoding (`assistant_model`")
    assert "\n" not in str(refusal.value)


HOST_READS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero")


def host_syncs(step) -> int:
    """How often ``step()`` itself read a tensor's value back to the host (`.item()`, `bool()`, `int()` of a tensor:
    ``aten::_local_scalar_dense``), which waits for the device on an accelerator. Reads inside another operator are
    that operator's CPU implementation (torch's CPU ``_grouped_mm`` reads its offsets; its CUDA kernel does not)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    count = 0
    for event in profile.events():
        if event.name != HOST_READS[0]:
            continue
        caller = event.cpu_parent
        while caller is not None and caller.name in HOST_READS:
            caller = caller.cpu_parent
        count += caller is None or not caller.name.startswith("aten::")
    return count


def test_training_and_decoding_forwards_never_wait_for_the_device(model):
    """The cached length is read from an MLA layer as a Python int; transformers 5.25 counts a KDA layer's tokens in a
    0-dim tensor. Embeddings are passed directly: token ids on a CPU are range-checked, which reads them back."""
    embeds = model.get_input_embeddings()(torch.randint(3, 97, (2, 7))).detach()
    labels = torch.randint(3, 97, (2, 7))
    assert host_syncs(lambda: model(inputs_embeds=embeds, labels=labels, use_cache=True).loss.backward()) == 0
    model.zero_grad()
    with torch.no_grad():
        cache = getattr(model(inputs_embeds=embeds, use_cache=True), CACHE_FIELD)
        assert host_syncs(lambda: model(inputs_embeds=embeds[:, :1], cache=cache)) == 0
        assert host_syncs(lambda: model(inputs_embeds=embeds[:, :3], cache=cache)) == 0


def test_sampling_with_a_fixed_seed_is_reproducible(model):
    ids, mask = left_padded_prompts([5, 8])
    kwargs = dict(attention_mask=mask, max_new_tokens=15, do_sample=True, top_k=20, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        torch.manual_seed(7)
        first = model.generate(ids, **kwargs)
        torch.manual_seed(7)
        second = model.generate(ids, **kwargs)
    assert torch.equal(first, second)


def test_beam_search_reorders_both_cache_kinds(model):
    ids, mask = left_padded_prompts([6, 9])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_prefill_then_single_token_steps_match_one_full_forward(model, exact_model):
    ids = torch.randint(3, 97, (2, 70))
    with torch.no_grad():
        full, exact = model(ids).logits, exact_model(ids).logits
        out = model(ids[:, :50], use_cache=True)
        cache, steps = getattr(out, CACHE_FIELD), [out.logits]
        for t in range(50, 70):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    assert_as_accurate(torch.cat(steps, dim=1), full, exact, what="cached logits")


def test_multi_token_continuation_matches_full_forward(model, exact_model):
    ids = torch.randint(3, 97, (2, 40))
    with torch.no_grad():
        full, exact = model(ids).logits, exact_model(ids).logits
        first = model(ids[:, :23], use_cache=True)
        second = model(ids[:, 23:], cache=getattr(first, CACHE_FIELD), use_cache=True)
    assert_as_accurate(torch.cat([first.logits, second.logits], dim=1), full, exact, what="cached logits")


def test_forward_returns_a_hybrid_cache_and_none_without_cache(model):
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True), CACHE_FIELD)
        assert getattr(model(ids, use_cache=False), CACHE_FIELD) is None
    assert isinstance(cache, DynamicCache)
    kinds = [type(layer) for layer in cache.layers]
    expected = [LinearAttentionLayer if t == "linear_attention" else DynamicLayer for t in model.config.layer_types]
    assert kinds == expected
    assert cache.get_seq_length() == 5


def cache_bytes(cache):
    kda = mla = 0
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            tensors = list(layer.conv_states.values()) + list(layer.recurrent_states.values())
            kda += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        else:
            mla += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return kda, mla


def test_kda_cache_is_constant_and_mla_cache_grows_linearly(model):
    sizes = {}
    with torch.no_grad():
        for length in (16, 64, 256):
            sizes[length] = cache_bytes(getattr(model(torch.randint(3, 97, (1, length)), use_cache=True), CACHE_FIELD))
    assert sizes[16][0] == sizes[64][0] == sizes[256][0] > 0
    per_token = (sizes[256][1] - sizes[64][1]) / 192
    assert per_token == (sizes[64][1] - sizes[16][1]) / 48
    cfg = model.config
    assert per_token == 3 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # 3 MLA layers, compressed latent, fp32


def test_cache_from_another_batch_size_fails_rather_than_computing(model):
    """The cached latents of the MLA layers do not concatenate with another batch's (torch refuses the cat)."""
    with torch.no_grad():
        cache = getattr(model(torch.randint(3, 97, (2, 6)), use_cache=True), CACHE_FIELD)
        for batch_size in (1, 3):
            with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
                model(torch.randint(3, 97, (batch_size, 1)), cache=cache, use_cache=True)


def test_mismatched_attention_mask_fails_clearly(model):
    ids, mask = left_padded_prompts([5, 7])
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=3, pad_token_id=0, eos_token_id=None)


def test_generation_config_is_saved(tmp_path, model):
    model.generation_config = GenerationConfig(max_new_tokens=5, pad_token_id=0)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").exists()


def test_cache_is_accepted_under_both_argument_names(model, exact_model):
    """transformers >= 5.24 passes `cache=`, earlier versions `past_key_values=`: both continue the same cache. Where
    `cache` is the name, `past_key_values` warns that it is deprecated (as transformers' own models do)."""
    ids = torch.randint(3, 97, (2, 12))
    legacy_warns = CACHE_FIELD == "cache"
    with torch.no_grad():
        full, exact = model(ids).logits[:, -1], exact_model(ids).logits[:, -1]
        for name in ("cache", "past_key_values"):
            prefix = getattr(model(ids[:, :-1], use_cache=True), CACHE_FIELD)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step = model(ids[:, -1:], use_cache=True, **{name: prefix})
            deprecations = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
            assert len(deprecations) == (name == "past_key_values" and legacy_warns), name
            assert_as_accurate(step.logits[:, -1], full, exact, what=f"logits through {name}")
            assert getattr(step, CACHE_FIELD) is prefix
        prefix = getattr(model(ids[:, :-1], use_cache=True), CACHE_FIELD)
        with pytest.raises(ValueError, match="[Bb]oth"):
            model(ids[:, -1:], cache=prefix, past_key_values=prefix)


def test_generate_stops_at_the_position_limit_with_transformers_reminder(caplog):
    """Past ``max_position_embeddings`` the forward refuses the sequence: generation ends there, saying so, with the
    tokens a longer limit would have produced up to it."""
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    model = KimiK3ForCausalLM(tiny_config(max_position_embeddings=16)).eval()
    with caplog.at_level("WARNING"):
        stopped = model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert stopped.shape == (1, 16)
    assert "exceed the model's predefined maximum length (16): generation stops at 16 tokens" in caplog.text
    longer = KimiK3ForCausalLM(tiny_config(max_position_embeddings=64)).eval()
    longer.load_state_dict(model.state_dict())
    assert torch.equal(longer.generate(prompt, max_new_tokens=6, do_sample=False), stopped)
