"""The K3 block stack against naive implementations written from the K3 report (§2) and its papers."""

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from modeling_kimi_k3 import (
    KimiK3ForCausalLM,
    KimiK3GLUActivation,
    KimiK3MLAAttention,
    KimiK3SparseMoeBlock,
    block_attention_residual,
    situ_and_mul,
)
from kimi_k3.policies.quantile_balancing import QuantileBalancing
from tests.conftest import TEST_DEVICE, seeded_generator, tiny_config
from tests.numerics import assert_as_accurate, float64_copy

pytestmark = pytest.mark.device  # runs on KIMI_K3_TEST_DEVICE (tests/conftest.py)


def build(config=None, dtype=torch.float64, **overrides):
    config = config or tiny_config(**overrides)
    model = KimiK3ForCausalLM(config).to(dtype).eval()
    if dtype == torch.float64:
        model.set_experts_implementation("eager")  # grouped_mm kernels have no fp64 path
    with torch.no_grad():  # non-trivial AttnRes pseudo-queries, router biases and gates
        for name, param in model.named_parameters():
            if "res_proj" in name:
                param.normal_(0, 0.5)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    return model


# ---------------------------------------------------------------------------------------- SiTU (K3 report Eq. 12)
def test_situ_matches_formula_fp64():
    g, u = torch.randn(1000, dtype=torch.float64) * 6, torch.randn(1000, dtype=torch.float64) * 60
    expected = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert (situ_and_mul(g, u, 4.0, 25.0) - expected).abs().max() <= 1e-12


def test_situ_bounds_are_attained_and_never_exceeded():
    g = torch.linspace(-200, 200, 4001)
    u = torch.linspace(-500, 500, 2001)
    out = situ_and_mul(g[:, None], u[None, :], 4.0, 25.0)
    assert out.max().item() == pytest.approx(100.0, abs=1e-4) and out.max() <= 100.0
    assert out.min().item() == pytest.approx(-100.0, abs=1e-4) and out.min() >= -100.0
    fine = torch.linspace(-3, 0, 300001, dtype=torch.float64)
    gate = 4 * torch.tanh(fine / 4) * torch.sigmoid(fine)
    assert gate.min().item() == pytest.approx(-0.269769, abs=1e-5)
    assert fine[gate.argmin()].item() == pytest.approx(-1.219, abs=2e-3)
    bf16 = situ_and_mul(torch.tensor([1e4, -1e4], dtype=torch.bfloat16), torch.tensor([3e4, -3e4], dtype=torch.bfloat16), 4.0, 25.0)
    assert bf16.dtype == torch.bfloat16 and bf16.tolist() == [100.0, 0.0]


@pytest.mark.parametrize("point,expected", [(0.0, 0.5), (2.0, 0.88678), (10.0, 0.026770)])
def test_situ_gate_derivative(point, expected):
    g = torch.tensor(point, dtype=torch.float64, requires_grad=True)
    situ_and_mul(g, torch.tensor(1.0, dtype=torch.float64), 4.0, None).backward()
    assert g.grad.item() == pytest.approx(expected, abs=1e-5)


def test_situ_recovers_swiglu_for_huge_betas():
    g, u = torch.linspace(-10, 10, 101, dtype=torch.float64), torch.linspace(10, -10, 101, dtype=torch.float64)
    # The caps deviate by x³/(3β²) per factor: 6.7e-9 absolute at |g| = |u| = 10, i.e. < 1e-9 relative.
    torch.testing.assert_close(situ_and_mul(g, u, 1e6, 1e6), F.silu(g) * u, rtol=1e-9, atol=1e-12)


def test_situ_config_plumbing():
    config = tiny_config(activation_situ_beta=None, activation_situ_linear_beta=None)
    glu = KimiK3GLUActivation(config)
    g, u = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64) * 100
    torch.testing.assert_close(glu(g, u), torch.tanh(g) * torch.sigmoid(g) * u)  # beta 1.0, no up cap
    model = KimiK3ForCausalLM(tiny_config())
    glus = [m for m in model.modules() if isinstance(m, KimiK3GLUActivation)]
    assert len(glus) == 1 + 8 * 2 and all(m.act_fn is None and (m.beta, m.linear_beta) == (4.0, 25.0) for m in glus)


# ------------------------------------------------------------------------------------ Gated MLA (K3 report Eq. 7)
def causal_mask(seq_len, dtype=torch.float64):
    blocked = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    return torch.zeros(1, 1, seq_len, seq_len, dtype=dtype).masked_fill(blocked, float("-inf"))


def naive_mla(attn: KimiK3MLAAttention, x: torch.Tensor) -> torch.Tensor:
    """Unfused einsum MLA: NoPE, shared unrotated k_r, (nope+rope)^-1/2 scale, sigmoid gate from x before o_proj."""
    batch, seq, _ = x.shape
    heads, nope, rope, v_dim = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim

    def rms(t, weight, eps):
        return weight * (t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps))

    q = rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight, 1e-6) @ attn.q_b_proj.weight.T
    q = q.view(batch, seq, heads, nope + rope)
    c = x @ attn.kv_a_proj_with_mqa.weight.T
    c_kv, k_r = c[..., : attn.kv_lora_rank], c[..., attn.kv_lora_rank :]
    kv = (rms(c_kv, attn.kv_a_layernorm.weight, 1e-6) @ attn.kv_b_proj.weight.T).view(batch, seq, heads, nope + v_dim)
    k = torch.cat([kv[..., :nope], k_r[:, :, None, :].expand(-1, -1, heads, -1)], dim=-1)
    v = kv[..., nope:]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(nope + rope)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(batch, seq, heads * v_dim)
    out = out * torch.sigmoid(x @ attn.g_proj.weight.T)
    return out @ attn.o_proj.weight.T


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_mla_matches_naive_einsum(implementation):
    model = build(attn_implementation=implementation)
    attn = model.model.layers[3].self_attn
    x = torch.randn(2, 11, model.config.hidden_size, dtype=torch.float64)
    out, _ = attn(x, attention_mask=causal_mask(11))
    assert (out - naive_mla(attn, x)).abs().max() <= 1e-10


def test_mla_absorbed_decode_matches_expanded_attention():
    model = build()
    attn = model.model.layers[8].self_attn
    x = torch.randn(2, 9, model.config.hidden_size, dtype=torch.float64)
    queries = attn.project_queries(x)
    latent, shared_key = attn.compress_key_values(x)
    from modeling_kimi_k3 import eager_attention_forward

    mask = causal_mask(9)
    expanded, _ = attn._attend_expanded(eager_attention_forward, queries, latent, shared_key, mask)
    absorbed, _ = attn._attend_absorbed(eager_attention_forward, queries, latent, shared_key, mask)
    assert (expanded.reshape(2, 9, -1) - absorbed.reshape(2, 9, -1)).abs().max() <= 1e-10


def test_mla_gate_reads_normed_input_and_halves_output_when_zero():
    model = build()
    attn = model.model.layers[3].self_attn
    x = torch.randn(1, 6, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        attn.g_proj.weight.zero_()
        gated, _ = attn(x, attention_mask=causal_mask(6))
        attn.g_proj = None
        ungated, _ = attn(x, attention_mask=causal_mask(6))
    torch.testing.assert_close(gated, 0.5 * ungated, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_mla_attention_output_reaches_the_gate_in_fp32_under_bf16_autocast(implementation):
    """K3 keeps the attention output in FP32 in training; the gated product is cast to bf16 only by o_proj."""
    model = build(attn_implementation=implementation).float().train()
    attn = model.model.layers[3].self_attn
    x = torch.randn(2, 11, model.config.hidden_size)
    gated_inputs = []
    attn.o_proj.register_forward_pre_hook(lambda module, args: gated_inputs.append(args[0]))
    with torch.autocast(TEST_DEVICE.type, dtype=torch.bfloat16):
        out, _ = attn(x, attention_mask=causal_mask(11).float())
        queries = attn.project_queries(x)
        keys, values = attn.expand_key_values(*attn.compress_key_values(x))
        gate = torch.sigmoid(attn.g_proj(x))
    assert out.dtype == torch.bfloat16 and gated_inputs[0].dtype == torch.float32
    # The reference: fp32 attention over the bf16 projections, times the bf16 gate (and the same in fp64).
    def gated_attention(dtype):
        scores = (queries.to(dtype) @ keys.to(dtype).transpose(2, 3)) * attn.scaling + causal_mask(11).to(dtype)
        return (scores.softmax(-1) @ values.to(dtype)).transpose(1, 2).reshape(2, 11, -1) * gate.to(dtype)

    assert_as_accurate(gated_inputs[0], gated_attention(torch.float32), gated_attention(torch.float64))
    assert not torch.equal(gated_inputs[0], gated_inputs[0].bfloat16().float())


# ------------------------------------------------------------------ Block AttnRes (Attention Residuals, arXiv:2603.15031)
def naive_attn_res(partial, blocks, proj_weight, norm_weight, eps):
    candidates = blocks + [partial]
    scores = []
    for value in candidates:
        key = value / torch.sqrt((value * value).mean(-1, keepdim=True) + eps)
        scores.append((key * (norm_weight * proj_weight[0])).sum(-1))
    alpha = torch.softmax(torch.stack(scores, -1), -1)
    return sum(alpha[..., j : j + 1] * candidates[j] for j in range(len(candidates)))


def test_attn_res_matches_naive_softmax_mix():
    model = build()
    layer = model.model.layers[5]
    blocks = [torch.randn(2, 5, 32, dtype=torch.float64) * s for s in (1.0, 3.0)]
    partial = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        layer.mlp_res_norm.weight.normal_()
    out = block_attention_residual(partial, torch.stack(blocks, -2), layer.mlp_res_proj, layer.mlp_res_norm)
    ref = naive_attn_res(partial, blocks, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, 1e-5)
    assert (out - ref).abs().max() <= 1e-12


def naive_model_forward(model, input_ids, record):
    """Block AttnRes written out: snapshots at ℓ mod block == 0, partial sums, both AttnRes sites, final output mix."""
    inner, cfg = model.model, model.config
    partial, bank = inner.embed_tokens(input_ids), []
    for idx, layer in enumerate(inner.layers):
        x = partial if not bank else naive_attn_res(
            partial, bank, layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight, cfg.rms_norm_eps
        )
        if idx % cfg.attn_res_block_size == 0:
            bank, partial = bank + [partial], None
        record.append(("mixer", idx, x))
        mask = causal_mask(x.shape[1]) if layer.layer_type == "full_attention" else None
        a, _ = layer.self_attn(layer.input_layernorm(x), mask)
        partial = a if partial is None else partial + a
        y = naive_attn_res(partial, bank, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, cfg.rms_norm_eps)
        record.append(("ffn", idx, y))
        h = layer.post_attention_layernorm(y)
        partial = partial + (layer.block_sparse_moe(h) if hasattr(layer, "block_sparse_moe") else layer.mlp(h))
    h = naive_attn_res(partial, bank, inner.output_attn_res_proj.weight, inner.output_attn_res_norm.weight, cfg.rms_norm_eps)
    return model.lm_head(inner.norm(h))


def test_model_wiring_matches_naive_attn_res_at_every_sub_layer_input():
    model = build()
    ids = torch.randint(0, 97, (2, 13))
    seen = []
    hooks = [
        layer.input_layernorm.register_forward_hook(lambda m, i, o, idx=idx: seen.append(("mixer", idx, i[0])))
        for idx, layer in enumerate(model.model.layers)
    ] + [
        layer.post_attention_layernorm.register_forward_hook(lambda m, i, o, idx=idx: seen.append(("ffn", idx, i[0])))
        for idx, layer in enumerate(model.model.layers)
    ]
    logits = model(ids).logits
    for hook in hooks:
        hook.remove()
    reference = []
    ref_logits = naive_model_forward(model, ids, reference)
    assert [r[:2] for r in reference] == [s[:2] for s in seen]
    for (kind, idx, ref), (_, _, got) in zip(reference, seen):
        assert (ref - got).abs().max() <= 1e-10, (kind, idx)
    assert (logits - ref_logits).abs().max() <= 1e-10


def test_disabled_attn_res_is_a_plain_pre_norm_stack():
    model = build(attn_res_block_size=None)
    assert not any("res_proj" in name for name, _ in model.named_parameters())
    ids = torch.randint(0, 97, (1, 6))
    h = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        mask = causal_mask(6) if layer.layer_type == "full_attention" else None
        h = h + layer.self_attn(layer.input_layernorm(h), mask)[0]
        ffn = layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
        h = h + ffn(layer.post_attention_layernorm(h))
    torch.testing.assert_close(model(ids).logits, model.lm_head(model.model.norm(h)), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- Router and experts (K3 report §2.3)
def naive_latent_moe(block: KimiK3SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    tokens = x.reshape(-1, x.shape[-1])
    gate = block.gate
    scores = torch.sigmoid(tokens @ gate.weight.T)
    chosen = torch.topk(scores + gate.e_score_correction_bias, gate.top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
    latent = tokens @ block.routed_expert_down_proj.weight.T
    experts = block.experts
    inter = experts.intermediate_dim
    combined = torch.zeros_like(latent)
    for t in range(tokens.shape[0]):
        for slot, e in enumerate(chosen[t].tolist()):
            w1, w3 = experts.gate_up_proj[e, :inter], experts.gate_up_proj[e, inter:]
            hidden = situ_and_mul(latent[t] @ w1.T, latent[t] @ w3.T, 4.0, 25.0)
            combined[t] += weights[t, slot] * (hidden @ experts.down_proj[e].T)
    routed = block.routed_expert_norm(combined) @ block.routed_expert_up_proj.weight.T
    return routed.view_as(x) + block.shared_experts(x)


@pytest.mark.parametrize("implementation,dtype,tolerance", [("eager", torch.float64, 1e-10), ("grouped_mm", torch.float32, 1e-5), ("batched_mm", torch.float32, 1e-5)])
def test_latent_moe_matches_naive_per_token_loop(implementation, dtype, tolerance):
    model = build(dtype=dtype, routed_scaling_factor=2.5)
    model.set_experts_implementation(implementation)
    block = model.model.layers[2].block_sparse_moe
    x = torch.randn(3, 7, 32, dtype=dtype)
    assert (block(x) - naive_latent_moe(block, x)).abs().max() <= tolerance


def test_experts_backends_agree_in_fp32_forward_and_backward():
    model = KimiK3ForCausalLM(tiny_config()).train()
    ids = torch.randint(0, 97, (2, 24))
    results = {}
    for implementation, dtype in (("eager", torch.float64), ("eager", torch.float32), ("grouped_mm", torch.float32),
                                  ("batched_mm", torch.float32)):
        model.to(dtype).set_experts_implementation(implementation)
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grad = model.model.layers[1].block_sparse_moe.experts.gate_up_proj.grad.clone()
        results[implementation, dtype] = (loss.detach(), grad)
    exact_loss, exact_grad = results["eager", torch.float64]
    ref_loss, ref_grad = results["eager", torch.float32]
    for implementation in ("grouped_mm", "batched_mm"):
        loss, grad = results[implementation, torch.float32]
        assert_as_accurate(loss, ref_loss, exact_loss, what=f"{implementation} loss")
        assert_as_accurate(grad, ref_grad, exact_grad, what=f"{implementation} gradient")


def test_router_weights_ignore_the_bias_which_gets_no_gradient():
    block = build(dtype=torch.float32).model.layers[1].block_sparse_moe
    gate = block.gate
    tokens = torch.randn(64, 32)
    _, weights_a, idx_a = gate(tokens)
    with torch.no_grad():
        gate.e_score_correction_bias.add_(0.123)  # a common shift selects the same experts
    _, weights_b, idx_b = gate(tokens)
    assert torch.equal(idx_a.sort(-1).values, idx_b.sort(-1).values)
    torch.testing.assert_close(weights_a.gather(1, idx_a.argsort(-1)), weights_b.gather(1, idx_b.argsort(-1)))
    assert "e_score_correction_bias" not in dict(gate.named_parameters())
    assert not gate.e_score_correction_bias.requires_grad


def test_router_routes_top_k_of_biased_scores_and_weighs_unbiased_ones_in_training():
    model = build(dtype=torch.float32)
    balancing = QuantileBalancing(model)
    balancing.attach()
    statistics = balancing.statistics["layer_1"]
    gate = model.model.layers[1].block_sparse_moe.gate.train()
    tokens = torch.randn(40, 32)
    _, weights, indices = gate(tokens)
    scores = torch.sigmoid(tokens @ gate.weight.T)
    biased = scores + gate.e_score_correction_bias
    expected = torch.topk(biased, gate.top_k, dim=-1)
    assert torch.equal(indices.sort(-1).values, expected.indices.sort(-1).values)
    chosen = scores.gather(1, indices)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    assert statistics.tokens_per_expert.sum() == 40 * gate.top_k
    assert statistics.histogram.sum() == 40 * gate.num_experts


# ---------------------------------------------------------------------------------------------- whole model
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_unpadded_single_runs(side):
    model = build(dtype=torch.float32)
    lengths = [9, 5, 7]
    rows = [torch.randint(3, 97, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    batched = model(ids, attention_mask=mask).logits
    exact_model = float64_copy(model)
    for i, row in enumerate(rows):
        single, exact = model(row[None]).logits[0], exact_model(row[None]).logits[0]
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        assert_as_accurate(batched[i, span], single, exact, what=f"row {i}")


def test_save_pretrained_round_trip_is_bit_exact_with_released_key_names(tmp_path):
    model = build(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w1.weight" in keys
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in keys
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in keys
    assert not any("gate_up_proj" in key or "down_proj" in key and "experts." in key and ".w" not in key for key in keys)
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in keys
    assert set(keys) == set(released_text_keys(model.config))
    reloaded = KimiK3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 97, (2, 10))
    assert torch.equal(model(ids).logits, reloaded(ids).logits)


def released_text_keys(config):
    """The released text key set (the release's index), with experts unpacked and A_log of length num_heads."""
    keys = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    keys += ["model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"]
    kda = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj", "q_conv1d", "k_conv1d",
           "v_conv1d", "o_norm"]
    mla = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
           "o_proj"]
    moe = ["gate", "routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj",
           "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        keys += [p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                                             "mlp_res_norm", "self_attention_res_proj", "mlp_res_proj")]
        if config.layer_types[i] == "linear_attention":
            keys += [p + f"self_attn.{n}.weight" for n in kda] + [p + "self_attn.dt_bias", p + "self_attn.A_log"]
        else:
            keys += [p + f"self_attn.{n}.weight" for n in mla]
        if config.mlp_layer_types[i] == "dense":
            keys += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        else:
            keys += [p + f"block_sparse_moe.{n}.weight" for n in moe]
            keys += [p + "block_sparse_moe.gate.e_score_correction_bias"]
            keys += [p + f"block_sparse_moe.experts.{e}.{w}.weight" for e in range(config.num_experts) for w in ("w1", "w2", "w3")]
    return keys


def unfused_parameter_count_and_keys(model):
    """State-dict names and sizes as stored on disk: fused experts split back into per-expert w1/w3/w2."""
    names, total = [], 0
    for name, tensor in model.state_dict().items():
        total += tensor.numel()
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            parts = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            names += [f"{prefix}.{e}.{w}.weight" for e in range(tensor.shape[0]) for w in parts]
        else:
            names.append(name)
    return total, names


def test_released_configuration_has_the_released_parameter_count_and_keys():
    with torch.device("meta"):
        model = KimiK3ForCausalLM(KimiK3Config_kimi_k3())
    total, names = unfused_parameter_count_and_keys(model)
    # released 2,779,484,478,208 minus 32 zero-padding A_log entries in each of the 69 KDA layers
    assert total == 2_779_484_476_000
    assert sorted(names) == sorted(released_text_keys(model.config))
    trainable = sum(p.numel() for p in model.parameters())
    assert total - trainable == 92 * 896  # the router biases are buffers


def KimiK3Config_kimi_k3():
    from configuration_kimi_k3 import KimiK3Config

    return KimiK3Config.kimi_k3()


def test_bf16_load_keeps_precision_critical_tensors_in_fp32(tmp_path):
    KimiK3ForCausalLM(tiny_config()).save_pretrained(tmp_path)
    model = KimiK3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    state = model.state_dict()
    for name, tensor in state.items():
        fp32 = any(key in name for key in ("A_log", "dt_bias", "conv1d", "o_norm", "e_score_correction_bias"))
        assert tensor.dtype == (torch.float32 if fp32 else torch.bfloat16), name
    ids = torch.randint(0, 97, (2, 9))
    assert torch.isfinite(model(ids).logits.float()).all()


@pytest.mark.parametrize("use_reentrant,router_runs", [(False, 2), (True, 1)])
def test_activation_checkpointing_gives_the_same_gradients(use_reentrant, router_runs):
    model = build(dtype=torch.float32).train()
    balancing = QuantileBalancing(model)
    balancing.attach()
    statistics = balancing.statistics["layer_1"]
    ids = torch.randint(0, 97, (2, 16))
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    hist = statistics.histogram.clone()
    model.zero_grad()
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == plain.keys()
    for name, grad in plain.items():
        assert torch.equal(grads[name], grad), name
    # Non-reentrant checkpointing records in the forward and again in the recompute; the reentrant forward runs
    # without gradients, so only its recompute records. Either way the histogram scales uniformly.
    assert torch.equal(statistics.histogram, (1 + router_runs) * hist)


def test_logits_to_keep_and_loss_with_ignored_labels():
    model = build(dtype=torch.float32)
    ids = torch.randint(0, 97, (2, 12))
    full = model(ids).logits
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits, full[:, -1:])
    labels = ids.clone()
    labels[:, :5] = -100
    loss = model(ids, labels=labels).loss
    expected = F.cross_entropy(full[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, expected)


def test_tiny_model_learns_python_docs():
    import pydoc_data.topics

    text = " ".join(list(pydoc_data.topics.topics.values())[:40])
    data = torch.tensor(list(text.encode("utf-8")[:20000]), dtype=torch.long)
    config = tiny_config(vocab_size=256, hidden_size=64)
    model = KimiK3ForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = seeded_generator(0)
    losses = []
    for _ in range(30):
        starts = torch.randint(0, len(data) - 49, (4,), generator=generator)
        batch = torch.stack([data[s : s + 48] for s in starts])
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5


BAD_INPUTS = [
    (dict(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 5)), "attention_mask"),
    (dict(), "exactly one"),
    (dict(input_ids=torch.zeros(1, 600, dtype=torch.long)), "max_position_embeddings"),
]
# Inputs that torch itself refuses (the embedding, the first projection): no check of the model's stands in front.
INPUTS_TORCH_REFUSES = {
    "float ids": dict(input_ids=torch.zeros(2, 3, dtype=torch.float32)),
    "ids beyond the vocabulary": dict(input_ids=torch.full((1, 4), 500)),
    "one-dimensional ids": dict(input_ids=torch.zeros(5, dtype=torch.long)),
    "embeddings of another width": dict(inputs_embeds=torch.zeros(1, 4, 7)),
}


@pytest.mark.parametrize("inputs,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(inputs, message):
    model = build(dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        model(**inputs)


@pytest.mark.parametrize("inputs", INPUTS_TORCH_REFUSES.values(), ids=INPUTS_TORCH_REFUSES)
def test_malformed_inputs_fail_rather_than_compute(inputs):
    with pytest.raises((RuntimeError, IndexError, ValueError)):
        build(dtype=torch.float32)(**inputs)


def test_fused_expert_layout_also_loads(tmp_path):
    model = build(dtype=torch.float32)
    model.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.gate_up_proj" in set(f.keys())
    reloaded = KimiK3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    # Memory-mapped fused tensors take transformers' grouped_mm fallback kernel: equal up to summation order.
    ids = torch.randint(0, 97, (1, 8))
    assert_as_accurate(reloaded(ids).logits, model(ids).logits, float64_copy(model)(ids).logits, what="logits")


def test_router_logits_and_layer_outputs_can_be_recorded():
    model = build(dtype=torch.float32)
    out = model(torch.randint(0, 97, (2, 5)), output_router_logits=True, output_hidden_states=True)
    assert len(out.router_logits) == 8 and out.router_logits[0].shape == (10, 8)
    assert len(out.hidden_states) == 1 + model.config.num_hidden_layers


def test_plain_load_state_dict_accepts_the_released_per_expert_layout(tmp_path):
    """Trainer resumes a checkpoint with ``model.load_state_dict(load_file(...))``: experts must not stay random."""
    from safetensors.torch import load_file

    source = build(dtype=torch.float32)
    source.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in on_disk
    target = KimiK3ForCausalLM(tiny_config())
    result = target.load_state_dict(on_disk, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name


def test_partial_per_expert_state_dict_is_an_error_not_a_silent_partial_load(tmp_path):
    from safetensors.torch import load_file

    source = build(dtype=torch.float32)
    source.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    del on_disk["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(RuntimeError, match="layers.2.block_sparse_moe.experts: the state dict holds only some"):
        KimiK3ForCausalLM(tiny_config()).load_state_dict(on_disk, strict=False)
