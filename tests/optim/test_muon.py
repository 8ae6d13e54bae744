"""Per-Head Muon: per-head and per-expert Newton–Schulz blocks, the parameter split, and training through Trainer."""

import re
import weakref

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from kimi_k3.optim.muon import (
    PerHeadMuon,
    PerHeadMuonFactory,
    build_param_groups,
    fused_adamw_applies,
    merge_row_blocks,
    split_row_blocks,
)
from kimi_k3.optim.newton_schulz import zeropower_via_newton_schulz5
from kimi_k3.policies.qk_clip import QKClipCallback
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config
from tests.numerics import BF16_EPS, assert_as_accurate
from variants_kimi_k3 import KimiK3VariantForCausalLM


def _one_step_update(grad, lr=1.0, **group):
    """The update -ΔW of one PerHeadMuon step from W = 0 (no decay)."""
    weight = torch.nn.Parameter(torch.zeros_like(grad))
    optimizer = PerHeadMuon([{"params": [weight], **group}], lr=lr, weight_decay=0.0)
    weight.grad = grad.clone()
    optimizer.step()
    return -weight.detach()


def _rms(tensor, dims):
    return tensor.pow(2).mean(dims).sqrt()


# ---------------------------------------------------------------------------------------------- per-head algebra


def test_head_block_update_ignores_other_heads_bitwise():
    torch.manual_seed(0)
    heads, rows, cols = 4, 8, 32
    grad = torch.randn(heads * rows, cols)
    perturbed = grad.clone()
    perturbed[rows:] *= 1000.0  # every head but head 0
    per_head = [_one_step_update(g, head_rows=rows)[:rows] for g in (grad, perturbed)]
    whole = [_one_step_update(g)[:rows] for g in (grad, perturbed)]
    assert torch.equal(per_head[0], per_head[1])
    assert (whole[0] - whole[1]).abs().max() > 1e-3 * whole[0].abs().max()


def test_per_head_blocks_equalize_update_rms_across_gradient_scales():
    torch.manual_seed(0)
    heads, rows, cols = 8, 16, 64
    scales = torch.logspace(-4, 3, heads)
    grad = (torch.randn(heads, rows, cols) * scales[:, None, None]).reshape(heads * rows, cols)
    per_head = _rms(_one_step_update(grad, head_rows=rows).view(heads, rows, cols), (1, 2))
    whole = _rms(_one_step_update(grad).view(heads, rows, cols), (1, 2))
    assert per_head.min() >= 0.15 and per_head.max() <= 0.22
    assert per_head.max() / per_head.min() < 1.2  # measured 1.06
    assert whole.max() / whole.min() > 1e4  # measured 1.08e5


@pytest.mark.parametrize("shape", [(6, 16, 64), (6, 64, 16), (3, 32, 96)])
def test_newton_schulz_blocks_are_near_orthogonal(shape):
    torch.manual_seed(0)
    singular_values = torch.linalg.svdvals(zeropower_via_newton_schulz5(torch.randn(shape)).float())
    assert singular_values.min() >= 0.6 and singular_values.max() <= 1.25


def test_single_block_matches_torch_muon_match_rms_adamw():
    torch.manual_seed(0)
    start = torch.randn(64, 32)
    ours, one_head, reference = (torch.nn.Parameter(start.clone()) for _ in range(3))
    optimizers = [
        PerHeadMuon([ours], lr=0.02, weight_decay=0.1),
        PerHeadMuon([{"params": [one_head], "head_rows": 64}], lr=0.02, weight_decay=0.1),
        torch.optim.Muon([reference], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                         adjust_lr_fn="match_rms_adamw"),
    ]
    for _ in range(3):
        grad = torch.randn(64, 32)
        for weight, optimizer in zip((ours, one_head, reference), optimizers):
            weight.grad = grad.clone()
            optimizer.step()
    relative_error = (ours - reference).norm() / (reference - start).norm()
    assert relative_error < 4 * BF16_EPS  # bf16 Newton–Schulz against fp32: a few bf16 roundings (measured 1.1e-2)
    assert torch.equal(ours, one_head)


def test_per_head_equals_torch_muon_on_each_head_slice():
    """Reference for the batched path: torch.optim.Muon run on every head block as a separate parameter."""
    torch.manual_seed(0)
    heads, rows, cols = 4, 8, 24
    start = torch.randn(heads * rows, cols)
    fused = torch.nn.Parameter(start.clone())
    slices = [torch.nn.Parameter(block.clone()) for block in start.split(rows)]
    ours = PerHeadMuon([{"params": [fused], "head_rows": rows}], lr=0.02, weight_decay=0.1)
    reference = torch.optim.Muon(slices, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grad = torch.randn(heads * rows, cols)
        fused.grad = grad.clone()
        for weight, block in zip(slices, grad.split(rows)):
            weight.grad = block.clone()
        ours.step()
        reference.step()
    expected = torch.cat([weight.detach() for weight in slices])
    assert (fused - expected).norm() / (expected - start).norm() < 4 * BF16_EPS  # bf16 NS (measured 1.3e-2)


def test_tall_mla_query_update_rms_transfers_from_whole_matrix():
    torch.manual_seed(0)
    heads, rows, cols = 8, 192, 256
    grad = torch.randn(heads * rows, cols)
    whole = _rms(_one_step_update(grad), (0, 1))
    per_head = _rms(_one_step_update(grad, head_rows=rows), (0, 1))
    assert 0.17 < whole < 0.21  # ≈ 0.19
    assert 0.16 < per_head < 0.20  # ≈ 0.18


def test_weight_decay_is_decoupled_and_exact():
    torch.manual_seed(0)
    start = torch.randn(16, 8)
    weight = torch.nn.Parameter(start.clone())
    optimizer = PerHeadMuon([{"params": [weight], "head_rows": 4}], lr=0.03, weight_decay=0.1)
    weight.grad = torch.zeros_like(weight)
    optimizer.step()
    assert torch.equal(weight.detach(), start * (1 - 0.03 * 0.1))


def _adamw_steps(dtype, grads, make_optimizer):
    """Parameters after stepping ``make_optimizer(params)`` through ``grads`` from fixed starting values."""
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(grad.shape, dtype=dtype)) for grad in grads[0]]
    optimizer = make_optimizer(params)
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.to(dtype)
        optimizer.step()
    return [param.detach() for param in params]


def test_adamw_groups_step_as_torch_fused_adamw_and_as_accurately_as_its_reference_loop():
    torch.manual_seed(0)
    shapes = [(300,), (7, 33), (1, 256)]
    # Gradients over seven orders of magnitude, so eps and the second moment both matter.
    grads = [[torch.randn(shape) * 10 ** torch.empty(shape).uniform_(-6, 1) for shape in shapes] for _ in range(6)]
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def ours(params):
        return PerHeadMuon([{"params": params, "use_muon": False}], lr=hyper["lr"], betas=hyper["betas"],
                           eps=hyper["eps"], weight_decay=hyper["weight_decay"])

    def torch_adamw(**loop):
        return lambda params: torch.optim.AdamW(params, **hyper, **loop)

    actual = _adamw_steps(torch.float32, grads, ours)
    fused = _adamw_steps(torch.float32, grads, torch_adamw(fused=True))
    trusted = _adamw_steps(torch.float32, grads, torch_adamw(foreach=False))
    exact = _adamw_steps(torch.float64, grads, torch_adamw(foreach=False))
    for index, (a, f, t, e) in enumerate(zip(actual, fused, trusted, exact)):
        assert torch.equal(a, f), f"parameter {index}: not torch's fused AdamW bit for bit"
        assert_as_accurate(a, t, e, what=f"AdamW parameter {index}")


def test_fused_adamw_takes_floating_point_cpu_tensors():
    assert fused_adamw_applies([torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16)])
    assert not fused_adamw_applies([])
    assert not fused_adamw_applies([torch.zeros(3, device="meta")])
    assert not fused_adamw_applies([torch.zeros(3), torch.zeros(3, dtype=torch.int64)])


def test_split_kv_blocks_with_unequal_rows_round_trip():
    torch.manual_seed(0)
    matrix = torch.randn(2, 3 * (5 + 3), 7)
    blocks = split_row_blocks(matrix, (5, 3))
    assert [tuple(block.shape) for block in blocks] == [(6, 5, 7), (6, 3, 7)]
    assert torch.equal(merge_row_blocks(blocks, (5, 3), matrix.shape), matrix)


def test_stacked_expert_halves_equal_separate_w1_w3_matrices_bitwise():
    torch.manual_seed(0)
    experts, intermediate, latent = 3, 8, 16
    grad = torch.randn(experts, 2 * intermediate, latent)
    matrices = grad.reshape(2 * experts, intermediate, latent)
    separate = [_one_step_update(matrix) for matrix in matrices]
    stacked = _one_step_update(grad, expert_rows=intermediate)
    assert torch.equal(stacked.reshape_as(matrices), torch.stack(separate))


def test_a_single_process_step_holds_about_one_parameters_update_at_a_time(monkeypatch):
    """Each Nesterov update is dropped once its blocks are in the Newton–Schulz queue (waiting blocks are copied), so
    the step's memory does not grow with the number of parameters; before the queue it held every update at once."""
    alive, most = [], []
    momentum_and_update = PerHeadMuon._momentum_and_update

    def tracked(optimizer, job):
        update = momentum_and_update(optimizer, job)
        alive.append(weakref.ref(update))
        most.append(sum(ref() is not None for ref in alive))
        return update

    monkeypatch.setattr(PerHeadMuon, "_momentum_and_update", tracked)
    model = KimiK3ForCausalLM(tiny_config())
    optimizer = PerHeadMuon.for_model(model, lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert len(alive) > 50 and max(most) <= 2


def test_state_dict_round_trip_resumes_bitwise():
    torch.manual_seed(0)
    grads = [[torch.randn(16, 8), torch.randn(16)] for _ in range(4)]

    def make():
        weights = [torch.nn.Parameter(torch.ones(16, 8)), torch.nn.Parameter(torch.ones(16))]
        groups = [{"params": weights[:1], "head_rows": (4, 4)}, {"params": weights[1:], "use_muon": False}]
        return weights, PerHeadMuon(groups, lr=0.01)

    def run(weights, optimizer, steps):
        for step_grads in steps:
            for weight, grad in zip(weights, step_grads):
                weight.grad = grad.clone()
            optimizer.step()

    straight = make()
    run(*straight, grads)
    first = make()
    run(*first, grads[:2])
    resumed = make()
    resumed[1].load_state_dict(first[1].state_dict())
    with torch.no_grad():
        for target, source in zip(resumed[0], first[0]):
            target.copy_(source)
    run(*resumed, grads[2:])
    assert all(torch.equal(a, b) for a, b in zip(straight[0], resumed[0]))


# ---------------------------------------------------------------------------------------------- clear errors


def test_muon_group_rejects_conv_kernel():
    with pytest.raises(ValueError, match=r"3-D parameter of shape \(8, 1, 4\).*use_muon=False"):
        PerHeadMuon([torch.nn.Parameter(torch.zeros(8, 1, 4))])


def test_head_rows_must_divide_rows():
    with pytest.raises(ValueError, match=r"do not divide the 10 rows"):
        PerHeadMuon([{"params": [torch.nn.Parameter(torch.zeros(10, 4))], "head_rows": 4}])


def test_empty_per_head_group_is_refused():
    with pytest.raises(ValueError, match="head_rows"):
        PerHeadMuon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))]}, {"params": [], "head_rows": 4}])


def test_for_model_refuses_non_k3_model():
    with pytest.raises(ValueError, match="model_type == 'kimi_k3'"):
        PerHeadMuon.for_model(torch.nn.Linear(4, 4))


# ---------------------------------------------------------------------------------------------- on the tiny K3 model

_PER_HEAD = re.compile(r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj)\.weight$")


def _param_names(model):
    return {id(p): name for name, p in model.named_parameters()}


def test_param_groups_cover_every_trainable_parameter_once(config):
    model = KimiK3ForCausalLM(config)
    groups = build_param_groups(model)
    names = _param_names(model)
    grouped = [names[id(p)] for group in groups for p in group["params"]]
    assert sorted(grouped) == sorted(name for name, p in model.named_parameters() if p.requires_grad)
    per_head = {names[id(p)]: group["head_rows"] for group in groups if group.get("head_rows") for p in group["params"]}
    kda, mla = config.kda_layer_indices, config.mla_layer_indices
    assert set(per_head) == {name for name in names.values() if _PER_HEAD.search(name)}
    for name, rows in per_head.items():
        layer, proj = _PER_HEAD.search(name).groups()
        expected = {"q_b_proj": 12, "kv_b_proj": (8, 8)}.get(proj, 8)
        assert int(layer) in (mla if proj in ("q_b_proj", "kv_b_proj") else kda) and rows == expected
    adamw = {names[id(p)] for group in groups if not group["use_muon"] for p in group["params"]}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.output_attn_res_proj.weight"} <= adamw
    assert all(name in adamw for name, p in model.named_parameters() if p.ndim == 1 or "conv1d" in name
               or name.endswith("_res_proj.weight"))
    experts = {group.get("expert_rows"): len(group["params"]) for group in groups if group.get("expert_rows")}
    assert experts == {16: 8, 24: 8}  # gate_up in w1/w3 halves, down_proj whole; 8 MoE layers
    in_groups = {id(p) for group in groups for p in group["params"]}
    assert all(id(buffer) not in in_groups for name, buffer in model.named_buffers() if "e_score_correction" in name)


def test_fused_kv_option_tags_one_block_per_head(config):
    groups = build_param_groups(KimiK3ForCausalLM(config), split_kv=False)
    assert {group.get("head_rows") for group in groups} == {None, 8, 12, 16}


def test_whole_matrix_option_orthogonalises_each_attention_projection_as_one_block(config):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(config)
    groups = build_param_groups(model, per_head=False)
    assert {group.get("head_rows") for group in groups} == {None}
    names = _param_names(model)
    whole = {names[id(p)] for group in groups if group["use_muon"] and group.get("expert_rows") is None
             for p in group["params"]}
    assert {name for name in names.values() if _PER_HEAD.search(name)} <= whole
    assert {group.get("expert_rows") for group in groups} == {None, 16, 24}  # experts keep their blocks
    optimizer = PerHeadMuon.for_model(model, lr=1.0, weight_decay=0.0, per_head=False, ns_dtype="float32")
    weight = model.model.layers[config.mla_layer_indices[0]].self_attn.kv_b_proj.weight
    before, grad = weight.detach().clone(), torch.randn_like(weight)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    weight.grad = grad
    optimizer.step()
    # Nesterov from zero momentum: U = G + 0.95 G; one block of the whole (k_nope ‖ v) matrix, RMS-matched.
    scale = 0.2 * max(weight.shape) ** 0.5
    trusted, exact = (zeropower_via_newton_schulz5(1.95 * grad[None].to(dtype), dtype=dtype)[0] * scale
                      for dtype in (torch.float32, torch.float64))
    assert_as_accurate(before - weight.detach(), trusted, exact, what="whole kv_b_proj update")


def test_frozen_head_projections_are_refused(config):
    model = KimiK3ForCausalLM(config)
    for name, p in model.named_parameters():
        if re.search(r"(q_b|kv_b)_proj", name):
            p.requires_grad_(False)
    with pytest.raises(ValueError, match="full_attention.*Per-Head Muon would be inert"):
        PerHeadMuon.for_model(model)


def _four_layer_config(**overrides):
    """KDA, MLA, KDA, MLA: every parameter kind at a third of the tiny model's step time, for Trainer runs."""
    layer_types = ["linear_attention", "full_attention"] * 2
    return tiny_config(num_hidden_layers=4, layer_types=layer_types, attn_res_block_size=2, **overrides)


def _training_args(output_dir, **overrides):
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=4, learning_rate=1e-2, report_to="none",
                  use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1000, save_strategy="no")
    return TrainingArguments(**{**values, **overrides})


def _token_dataset(config, sequences=64, length=16):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (sequences, length), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


class _LrRatios(TrainerCallback):
    def __init__(self):
        self.ratios = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.ratios.append([group["lr"] / group["initial_lr"] for group in optimizer.param_groups])


def test_trainer_default_scheduler_drives_muon_and_adamw_groups(tmp_path):
    config = _four_layer_config()
    model = KimiK3ForCausalLM(config)
    optimizer = PerHeadMuon.for_model(model, lr=1e-2, adamw_lr=3e-3)
    ratios = _LrRatios()
    start = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer = Trainer(model=model, args=_training_args(tmp_path, max_steps=4), train_dataset=_token_dataset(config),
                      optimizers=(optimizer, None), callbacks=[ratios])
    trainer.train()
    # One schedule for every group; HF's default is a linear decay to 0 over max_steps.
    assert ratios.ratios == [pytest.approx([ratio] * len(optimizer.param_groups)) for ratio in (0.75, 0.5, 0.25, 0)]
    assert {group["initial_lr"] for group in optimizer.param_groups} == {1e-2, 3e-3}
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, start)


def test_trainer_resume_from_checkpoint_is_bitwise(tmp_path):
    """Plain Trainer: its checkpoints hold the released per-expert keys, which the experts' load_state_dict takes."""
    config = _four_layer_config()
    factory = (PerHeadMuonFactory, {"lr": 1e-2, "weight_decay": 0.1})

    def train(output_dir, resume=None):
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(config)
        args = _training_args(output_dir, max_steps=30, save_strategy="steps", save_steps=20)
        trainer = Trainer(model=model, args=args, train_dataset=_token_dataset(config),
                          optimizer_cls_and_kwargs=factory, callbacks=[QKClipCallback(0.01)])
        trainer.train(resume_from_checkpoint=resume)
        return model

    straight = train(tmp_path / "straight")
    resumed = train(tmp_path / "resumed", resume=str(tmp_path / "straight" / "checkpoint-20"))
    for (name, expected), actual in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(expected, actual), name


def test_trainer_factory_trains_with_the_training_arguments_lr_and_weight_decay(tmp_path):
    config = _four_layer_config()
    model = KimiK3ForCausalLM(config)
    args = _training_args(tmp_path, max_steps=1, learning_rate=3e-4, weight_decay=0.02, adam_beta2=0.99)
    trainer = Trainer(model=model, args=args, train_dataset=_token_dataset(config),
                      optimizer_cls_and_kwargs=PerHeadMuonFactory.from_training_args(args))
    optimizer = trainer.create_optimizer()
    assert {group["lr"] for group in optimizer.param_groups} == {3e-4}
    assert {group["weight_decay"] for group in optimizer.param_groups} <= {0.0, 0.02}
    assert any(group["weight_decay"] == 0.02 for group in optimizer.param_groups)
    assert {group["betas"] for group in optimizer.param_groups} == {(0.9, 0.99)}
    bare = Trainer(model=model, args=args, train_dataset=_token_dataset(config),
                   optimizer_cls_and_kwargs=(PerHeadMuonFactory, {"lr": 3e-4}))
    with pytest.raises(ValueError, match=r"needs weight_decay.*from_training_args\(args\)"):
        bare.create_optimizer()


def test_shared_basis_banks_are_orthogonalised_per_expert_block_and_coefficients_go_to_adamw():
    config = tiny_config(expert_basis_size=3)
    model = KimiK3VariantForCausalLM(config)
    tags = {id(p): group for group in build_param_groups(model) for p in group["params"]}
    experts = model.model.layers[1].block_sparse_moe.experts
    gate_up, down = tags[id(experts.gate_up_basis)], tags[id(experts.down_basis)]
    assert gate_up["use_muon"] and gate_up["expert_rows"] == config.moe_intermediate_size  # w1 and w3 blocks
    assert down["use_muon"] and down["expert_rows"] == config.routed_expert_hidden_size
    assert not tags[id(experts.gate_up_coefficients)]["use_muon"]
    optimizer = PerHeadMuon.for_model(model, lr=1e-2, weight_decay=0.0, ns_dtype="float32")
    ids = torch.randint(3, 97, (2, 8))
    model(ids, labels=ids).loss.backward()
    grad = experts.gate_up_basis.grad
    nesterov = grad.add(grad, alpha=0.95)  # the first step's momentum buffer is the gradient
    blocks = nesterov.view(6, config.moe_intermediate_size, -1)  # w1 and w3 of each basis matrix
    before = experts.gate_up_basis.detach().clone()
    optimizer.step()
    update = (before - experts.gate_up_basis.detach()).view_as(blocks)
    scale = 1e-2 * 0.2 * max(blocks.shape[1:]) ** 0.5  # lr x Moonlight RMS matching
    assert_as_accurate(update, scale * zeropower_via_newton_schulz5(blocks, dtype=torch.float32),
                       scale * zeropower_via_newton_schulz5(blocks.double(), dtype=torch.float64),
                       what="basis blocks")
