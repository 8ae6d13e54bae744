"""MXFP4 quantization-aware training of the routed experts: the fake-quantizers against the exporter's codec and an
fp64 grid search, straight-through gradients, composition with the training pieces, and a lossless export."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

from kimi_k3.job import main as train
from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.quantization.qat import (
    attach_qat,
    COMPILED_MXFP4,
    fake_quantize_mxfp4,
    fake_quantize_mxfp4_eager,
    fake_quantize_mxfp4_reference,
    fake_quantize_mxfp8,
    find_routed_experts,
    qat_bytes_per_expert_weight,
)
from kimi_k3.checkpoint.release_format import export_released
from kimi_k3.text.corpus import load_corpus, tokenize_into_blocks
from kimi_k3.text.tokenizer import load_tokenizer
from modeling_kimi_k3 import KimiK3Experts, KimiK3ForCausalLM, situ_and_mul
from tests.conftest import tiny_config
from tests.job.test_train import TINY_MODEL, run_interrupted, run_main, tiny_args, write_corpus
from tests.numerics import assert_as_accurate
from variants_kimi_k3 import KimiK3VariantForCausalLM

# Expert input widths that MXFP4 can group (multiples of 32).
QAT_SHAPES = {"routed_expert_hidden_size": 32, "moe_intermediate_size": 32}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float().view(torch.int32)


def awkward_weights() -> torch.Tensor:
    """Random groups at many scales plus every corner of the grid: ties, zeros of both signs, subnormal groups."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 40, 64, generator=generator) * torch.logspace(-6, 3, 40)[None, :, None]
    weight[0, 0, :32] = torch.cat([torch.arange(25) * 0.25, torch.zeros(7)])  # every tie of the grid at scale 1
    weight[0, 1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * torch.tensor([1, -1] * 16)
    weight[0, 2] = 0.0
    weight[0, 3, :32] = -0.0
    weight[0, 4, :32] = 1e-40  # below 6 · 2^-127: the finest scale
    weight[0, 5, :32] = -1e-3
    weight[0, 5, 0] = 5.0  # small negatives round to -0
    return weight


def qat_model(**overrides) -> KimiK3ForCausalLM:
    model = KimiK3ForCausalLM(tiny_config(**QAT_SHAPES, **overrides))
    with torch.no_grad():  # experts large enough that MXFP4 rounding matters
        for experts in find_routed_experts(model).values():
            experts.gate_up_proj.normal_(0, 0.3)
            experts.down_proj.normal_(0, 0.3)
    return model


def fake_quantized_copy(model: KimiK3ForCausalLM) -> KimiK3ForCausalLM:
    """The same model with its expert parameters replaced by their MXFP4 values (no QAT hooks)."""
    copy = KimiK3ForCausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for experts in find_routed_experts(copy).values():
            experts.gate_up_proj.copy_(fake_quantize_mxfp4_reference(experts.gate_up_proj))
            experts.down_proj.copy_(fake_quantize_mxfp4_reference(experts.down_proj))
    return copy


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(5))


# ---------------------------------------------------------------------------------------------------------------------
# Fake-quantizers
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_mxfp4_fake_quantizer_equals_pack_then_unpack_bit_for_bit(dtype):
    weight = awkward_weights().to(dtype)
    fast, reference = fake_quantize_mxfp4_eager(weight), fake_quantize_mxfp4_reference(weight)
    assert fast.dtype == reference.dtype == dtype
    assert torch.equal(bits(fast), bits(reference))
    ties_to_even = [0, 0, 0.5, 1, 1, 1, 1.5, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6]
    assert torch.equal(fast[0, 0, :25], torch.tensor(ties_to_even, dtype=dtype))
    assert torch.equal(bits(fast[0, 3, :32]), torch.zeros(32, dtype=torch.int32))  # -0.0 is stored as +0
    assert torch.all(torch.signbit(fast[0, 5, 1:32]))  # -1e-3 rounds to -0 next to 5.0


def test_compiled_mxfp4_fake_quantizer_gives_the_eager_bits_and_large_weights_use_it():
    weight = awkward_weights()
    compiled = COMPILED_MXFP4(weight)
    assert COMPILED_MXFP4.compiled is not None and not COMPILED_MXFP4.failed
    assert torch.equal(bits(compiled), bits(fake_quantize_mxfp4_eager(weight)))
    large = torch.randn(8, 256, 128)
    assert torch.equal(bits(fake_quantize_mxfp4(large)), bits(fake_quantize_mxfp4_reference(large)))


def test_mxfp4_fake_quantizer_is_idempotent_and_error_bounded():
    weight = awkward_weights()
    once = fake_quantize_mxfp4(weight)
    assert torch.equal(fake_quantize_mxfp4(once), once)
    group_max = weight.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    error = (once - weight).unflatten(-1, (-1, 32)).abs()
    # Worst case: half the top step (2X, with X < group_max / 3), or the finest scale 2^-127 for tiny groups.
    assert torch.all(error <= torch.clamp_min(group_max / 3, 2.0**-127))


def e4m3_nearest_reference(values: torch.Tensor) -> torch.Tensor:
    """fp64 search over all finite E4M3 values: nearest, ties to the even code, saturating at ±448."""
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).double()
    finite = ~torch.isnan(grid)
    grid, codes = grid[finite], codes[finite].long()
    distance = (values.double()[..., None] - grid).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = distance == best
    even = candidates & (codes % 2 == 0)
    choice = torch.where(even.any(-1, keepdim=True), even, candidates).double().argmax(-1)
    return grid[choice]


def test_mxfp8_fake_quantizer_uses_the_ocp_scale_and_rounds_like_an_fp64_grid_search():
    generator = torch.Generator().manual_seed(4)
    activation = torch.randn(48, 64, generator=generator) * torch.logspace(-4, 4, 48)[:, None]
    activation[0, :32] = torch.linspace(-500, 500, 32)  # max 500: X = 2^(8 - 8) = 1, 500 saturates to 448
    activation[1, :32] = 0.0
    fake = fake_quantize_mxfp8(activation)
    groups = activation.unflatten(-1, (-1, 32)).double()
    scales = torch.exp2(torch.floor(torch.log2(groups.abs().amax(-1, keepdim=True).clamp_min(2.0**-127))) - 8)
    expected = (e4m3_nearest_reference((groups / scales).clamp(-448, 448)) * scales).flatten(-2)
    assert torch.equal(fake.double(), expected)
    assert fake[0, 0] == -448 and fake[0, 31] == 448
    assert torch.equal(fake[1, :32], torch.zeros(32))


def test_fake_quantizers_refuse_widths_that_are_not_multiples_of_32():
    with pytest.raises(ValueError, match="MXFP4 groups 32 input features"):
        fake_quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="MXFP8 groups 32 features"):
        fake_quantize_mxfp8(torch.zeros(4, 48))


# ---------------------------------------------------------------------------------------------------------------------
# The QAT mode on a model
# ---------------------------------------------------------------------------------------------------------------------
def test_qat_forward_is_the_fake_quantized_model_and_gradients_pass_straight_through(ids):
    model = qat_model()
    reference = fake_quantized_copy(model)
    attach_qat(model)
    logits = model(ids, labels=ids)
    expected = reference(ids, labels=ids)
    assert torch.equal(logits.logits, expected.logits)
    logits.loss.backward()
    expected.loss.backward()
    gradients, expected_gradients = dict(model.named_parameters()), dict(reference.named_parameters())
    for name, parameter in gradients.items():
        expected_gradient = expected_gradients[name].grad
        if expected_gradient is None:  # layer 0's unused AttnRes projection
            assert parameter.grad is None, name
        else:
            assert torch.equal(parameter.grad, expected_gradient), name
    assert len(find_routed_experts(model)) == 8
    assert all("parametrizations" not in key for key in model.state_dict())  # checkpoint names unchanged


def test_qat_leaves_master_weights_and_state_dict_alone_and_remove_restores_the_plain_forward(ids):
    model = qat_model()
    master = {key: value.clone() for key, value in model.state_dict().items()}
    plain = model(ids).logits
    qat = attach_qat(model)
    quantized = model(ids).logits
    assert not torch.equal(quantized, plain)
    assert all(torch.equal(master[key], value) for key, value in model.state_dict().items())
    experts = next(iter(find_routed_experts(model).values()))
    assert "gate_up_proj" not in vars(experts)  # the fake-quantized binding ends with the forward
    qat.remove()
    assert torch.equal(model(ids).logits, plain)


def test_mxfp8_activations_quantize_both_expert_inputs_and_nothing_else():
    experts = KimiK3Experts(tiny_config(**QAT_SHAPES))
    torch.nn.init.normal_(experts.gate_up_proj, 0, 0.3)
    torch.nn.init.normal_(experts.down_proj, 0, 0.3)
    tokens = torch.randn(10, 32) * 3
    top_k_index = torch.randint(0, 8, (10, 2), generator=torch.Generator().manual_seed(0))
    top_k_weights = torch.rand(10, 2)
    attach_qat(experts, activations="mxfp8")
    output = experts(tokens, top_k_index, top_k_weights)

    gate_up, down = fake_quantize_mxfp4(experts.gate_up_proj), fake_quantize_mxfp4(experts.down_proj)

    def per_token_loop(dtype):
        expected = torch.zeros(10, 32, dtype=dtype)
        for token in range(10):
            for slot in range(2):
                expert = top_k_index[token, slot]
                hidden = fake_quantize_mxfp8(tokens[token : token + 1]).to(dtype) @ gate_up[expert].to(dtype).T
                gate, up = hidden.chunk(2, dim=-1)
                glu = situ_and_mul(gate, up, experts.glu.beta, experts.glu.linear_beta)
                expected[token] += top_k_weights[token, slot] * (fake_quantize_mxfp8(glu.float()).to(dtype) @
                                                                   down[expert].to(dtype).T)[0]  # fmt: skip
        return expected

    assert_as_accurate(output, per_token_loop(torch.float32), per_token_loop(torch.float64), what="expert output")


def train_two_muon_steps(model, ids) -> None:
    optimizer = PerHeadMuon.for_model(model, lr=1e-2)
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_qat_with_gradient_checkpointing_and_per_head_muon_matches_the_plain_run(ids):
    def train(checkpointing: bool):
        torch.manual_seed(0)
        model = qat_model()
        attach_qat(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        train_two_muon_steps(model, ids)
        return model

    plain, checkpointed = train(False), train(True)
    for (name, value), other in zip(plain.state_dict().items(), checkpointed.state_dict().values()):
        assert torch.equal(value, other), name
    experts = next(iter(find_routed_experts(plain).values()))
    # Muon moved the master weights off the MXFP4 grid: they are not their own fake-quantization.
    assert not torch.equal(experts.gate_up_proj, fake_quantize_mxfp4(experts.gate_up_proj))


def test_exported_qat_model_loads_back_with_bitwise_equal_logits(ids, tmp_path):
    model = qat_model()
    attach_qat(model)
    model.train()
    train_two_muon_steps(model, ids)
    model.eval()
    with torch.no_grad():
        qat_logits = model(ids).logits
    model.save_pretrained(tmp_path / "ours")  # master weights
    export_released(tmp_path / "ours", tmp_path / "released", progress=False)
    released = KimiK3ForCausalLM.from_pretrained(tmp_path / "released").eval()
    with torch.no_grad():
        released_logits = released(ids).logits
    assert torch.equal(bits(released_logits), bits(qat_logits))
    master = KimiK3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert not torch.equal(master(ids).logits, qat_logits)  # the saved folder holds the master weights


# ---------------------------------------------------------------------------------------------------------------------
# Bad input and planning
# ---------------------------------------------------------------------------------------------------------------------
def test_attach_refuses_unknown_formats_models_without_experts_and_ungroupable_widths(tmp_path):
    model = qat_model()
    with pytest.raises(ValueError, match=r"weight format must be one of \['mxfp4'\], got 'nvfp4'"):
        attach_qat(model, "nvfp4")
    with pytest.raises(ValueError, match=r"activation format must be one of \['none', 'mxfp8'\], got 'fp8'"):
        attach_qat(model, activations="fp8")
    with pytest.raises(ValueError, match="this model has none"):
        attach_qat(KimiK3ForCausalLM(tiny_config(num_experts=None)))
    narrow = KimiK3ForCausalLM(tiny_config(routed_expert_hidden_size=48, moe_intermediate_size=32))
    with pytest.raises(ValueError, match=r"gate_up_proj has 48 input features \(routed_expert_hidden_size\); MXFP4"):
        attach_qat(narrow)
    narrow.save_pretrained(tmp_path / "narrow")
    with pytest.raises(ValueError, match="has 48 input features; MXFP4 groups need a multiple of 32"):
        export_released(tmp_path / "narrow", tmp_path / "released", progress=False)


def test_memory_report_counts_master_fake_quantized_copy_and_packed_export():
    sizes = qat_bytes_per_expert_weight((896, 6144, 3584))
    elements = 896 * 6144 * 3584
    assert sizes == {"master": 4 * elements, "fake_quantized": 4 * elements, "exported": elements // 2 + elements // 32}


# ---------------------------------------------------------------------------------------------------------------------
# kimi-k3-train --qat
# ---------------------------------------------------------------------------------------------------------------------
QAT_MODEL_OVERRIDES = ["--config_overrides", json.dumps(TINY_MODEL | QAT_SHAPES)]


def qat_run_args(output_dir: Path, corpus: Path, *extra: str) -> list[str]:
    """A 4-step QAT toy run with checkpoints at steps 2 and 4, its final folder in the released layout."""
    return tiny_args(output_dir, corpus, *QAT_MODEL_OVERRIDES, "--qat", "mxfp4", "--final_layout", "released",
                     "--max_steps", "4", "--save_steps", "2", "--eval_steps", "2", *extra)  # fmt: skip


def test_qat_training_job_resumes_bit_exactly_and_ships_what_it_evaluated(tmp_path, monkeypatch, ids):
    corpus = write_corpus(tmp_path)
    attached = []
    monkeypatch.setattr(train, "attach_qat", lambda model, *formats: attached.append(attach_qat(model, *formats)))
    status, printed = run_main(qat_run_args(tmp_path / "run", corpus))
    assert status == 0, printed
    assert [(qat.weights, qat.activations, len(qat.experts)) for qat in attached] == [("mxfp4", "none", 8)]
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "| quantization-aware training | MXFP4 routed experts (activations: full precision) |" in card
    assert "| weights on disk | released layout, MXFP4 routed experts |" in card and "| QK-Clip | tau = 100 |" in card
    run_interrupted(qat_run_args(tmp_path / "resumed", corpus), global_step=3)
    assert run_main(qat_run_args(tmp_path / "resumed", corpus, "--resume_from_checkpoint", "True"))[0] == 0
    expected = load_file(tmp_path / "run" / "checkpoint-4" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "checkpoint-4" / "model.safetensors")
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)

    # The checkpoint holds the master weights; the final folder the released MXFP4 experts, equal to the QAT forward.
    master = KimiK3ForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-4").eval()
    attach_qat(master)
    shipped = KimiK3ForCausalLM.from_pretrained(tmp_path / "run" / "model").eval()
    assert json.loads((tmp_path / "run" / "model" / "config.json").read_text())["model_type"] == "kimi_k3"
    inputs = ids % master.config.vocab_size
    with torch.no_grad():
        assert torch.equal(bits(shipped(inputs).logits), bits(master(inputs).logits))
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()

    # Running the finished job again: its folder records the last checkpoint, so nothing is rewritten.
    before = {path.name: path.read_bytes() for path in (tmp_path / "run" / "model").iterdir()}
    status, printed = run_main(qat_run_args(tmp_path / "run", corpus, "--resume_from_checkpoint", "True"))
    assert status == 0 and "nothing to do" in printed
    assert {path.name: path.read_bytes() for path in (tmp_path / "run" / "model").iterdir()} == before


QAT_BAD_INPUTS = {
    "model without routed experts": (["--config_overrides", json.dumps(TINY_MODEL | {"num_experts": None}),
                                      "--qat", "mxfp4"], "this model has none"),
    "expert widths not multiples of 32": (["--qat", "mxfp4"], "has 24 input features (routed_expert_hidden_size)"),
    "released layout of ungroupable experts": (["--final_layout", "released"], "--final_layout released: model"),
    "activation format without --qat": (["--qat_activations", "mxfp8"], "--qat_activations mxfp8 needs --qat mxfp4"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(QAT_BAD_INPUTS))
def test_bad_qat_input_stops_before_training_with_a_message(case, tmp_path, capsys):
    extra, message = QAT_BAD_INPUTS[case]
    assert train.main(tiny_args(tmp_path / "out", write_corpus(tmp_path), *extra)) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("kimi-k3-train: error:") and message in last_line
    assert not (tmp_path / "out").exists()


def test_unknown_qat_format_is_refused_by_the_argument_parser_naming_the_choices(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(tiny_args(tmp_path / "out", write_corpus(tmp_path), "--qat", "nvfp4"))
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --qat: invalid choice: 'nvfp4' (choose from" in message and "mxfp4" in message
    assert not (tmp_path / "out").exists()


def held_out_eval_loss(folder: Path, corpus: Path, tmp_path: Path) -> float:
    """The eval loss of ``folder`` reloaded as a user would, on the job's held-out blocks of ``corpus``."""
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = load_tokenizer(folder)
    splits, _ = load_corpus([str(corpus)], "text", 5.0)
    validation = tokenize_into_blocks(splits, tokenizer, block_size=32)["validation"]
    args = TrainingArguments(tmp_path / "eval", per_device_eval_batch_size=16, report_to="none", use_cpu=True)
    trainer = Trainer(model, args, eval_dataset=validation, data_collator=default_data_collator)
    return trainer.evaluate()["eval_loss"]


def test_qat_job_folder_reloads_as_its_own_mxfp4_export_with_the_cards_eval_loss(tmp_path, ids):
    corpus = write_corpus(tmp_path)
    extra = ["--qat", "mxfp4", "--max_steps", "6", "--save_steps", "3", "--eval_steps", "3"]
    assert run_main(tiny_args(tmp_path / "run", corpus, *QAT_MODEL_OVERRIDES, *extra))[0] == 0
    folder = tmp_path / "run" / "model"
    export_released(folder, tmp_path / "released", progress=False)  # what `kimi-k3-convert to-release` writes
    reloaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "released", trust_remote_code=True).eval()
    inputs = ids % reloaded.config.vocab_size
    with torch.no_grad():
        assert (reloaded(inputs).logits - exported(inputs).logits).abs().max() <= 1e-5

    # The checkpoint keeps the fp32 masters for resuming; the folder their MXFP4 values, which a QAT forward computes.
    master = KimiK3ForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-6").eval()
    assert not torch.equal(master.state_dict()["model.layers.1.block_sparse_moe.experts.down_proj"],
                           reloaded.state_dict()["model.layers.1.block_sparse_moe.experts.down_proj"])
    attach_qat(master)
    with torch.no_grad():
        assert torch.equal(bits(master(inputs).logits), bits(reloaded(inputs).logits))

    state = json.loads((tmp_path / "run" / "checkpoint-6" / "trainer_state.json").read_text())
    run_eval_loss = next(entry["eval_loss"] for entry in reversed(state["log_history"]) if "eval_loss" in entry)
    assert held_out_eval_loss(folder, corpus, tmp_path) == pytest.approx(run_eval_loss, rel=1e-6)
    card = (folder / "README.md").read_text()
    assert f"| final eval loss | {run_eval_loss:.3f} |" in card
    assert "routed experts on the MXFP4 grid (the checkpoints keep the masters)" in card


def test_qat_refuses_shared_basis_experts_in_one_line():
    with pytest.raises(ValueError, match=r"^QAT mxfp4 fake-quantizes each routed expert's own weight tensors; "
                                         r"shared-basis experts \(expert_basis_size\)"):
        attach_qat(KimiK3VariantForCausalLM(tiny_config(expert_basis_size=2, routed_expert_hidden_size=32,
                                                 moe_intermediate_size=32)))


def test_qat_trains_the_released_experts_of_the_routing_variants(ids):
    model = KimiK3VariantForCausalLM(tiny_config(dynamic_experts_per_token=True, routed_expert_hidden_size=32,
                                          moe_intermediate_size=32))
    handle = attach_qat(model)
    assert len(handle.experts) == model.config.mlp_layer_types.count("sparse")
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[1].block_sparse_moe.experts.gate_up_proj.grad.abs().max() > 0
