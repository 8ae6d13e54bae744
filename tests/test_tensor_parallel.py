"""Tensor parallelism by ``KimiK3Config.base_model_tp_plan``: the plan's coverage by transformers' own matching, its
shards of the released model (meta device, fake process group of 8 ranks), and 2 gloo processes loading saved
models with ``tp_plan="auto"`` against one process: logits, loss, every gradient, greedy generation."""

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig
from transformers.integrations.tensor_parallel import replace_layer_number_by_wildcard

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.planning.verify import fake_process_group
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import HANG_CEILING_S, tiny_config, torchrun
from tests.numerics import assert_as_accurate, perturb_parameters
from tests.dist_scripts import tensor_parallel as scenario

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = HANG_CEILING_S
# Styles that keep the parameters they name whole on every rank (some act on the module's inputs, outputs or
# gradients).
WHOLE_STYLES = ("replicate", "replicated_with_grad_allreduce", "mla_kv_a_proj", "local_params")


def released_layers(num_hidden_layers: int = 4) -> KimiK3Config:
    """The released widths over a few layers: dense layer 0, then MoE layers, KDA and MLA (the last)."""
    layer_types = ["linear_attention"] * (num_hidden_layers - 1) + ["full_attention"]
    return KimiK3Config.kimi_k3(num_hidden_layers=num_hidden_layers, layer_types=layer_types)


def test_every_parameter_has_a_rule_and_every_rule_names_a_module_or_parameter(config):
    """By transformers' matching: layer numbers become ``*``, and a parameter without a rule of its own takes its
    module's. (``verify_tp_plan`` is no judge: it wildcards the digit of ``q_conv1d`` and ignores parameter rules.)"""
    model = KimiK3ForCausalLM(config)
    plan = model.tp_plan
    modules = {replace_layer_number_by_wildcard(name) for name, _ in model.named_modules()}
    parameters = {replace_layer_number_by_wildcard(name) for name, _ in model.named_parameters()}
    assert plan.keys() <= modules | parameters
    assert [name for name in parameters if name not in plan and name.rpartition(".")[0] not in plan] == []
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"


def test_released_model_splits_into_whole_heads_and_equal_shards_over_8_ranks():
    """Every planned parameter of the released widths is cut into 8 equal shards along the dim its style names, each
    holding whole MLA and KDA heads; the rest (routers, latent projections, norms, AttnRes) is held whole."""
    config, tp = released_layers(), 8
    with fake_process_group(tp):
        with torch.device("meta"):
            model = KimiK3ForCausalLM(config)
        distributed_config, _, mesh = KimiK3ForCausalLM.prepare_distribute_model(DistributedConfig(tp_size=tp))
        model = KimiK3ForCausalLM.maybe_distribute_model(model, distributed_config, mesh)
        shapes = {name: (tuple(p.to_local().shape) if isinstance(p, DTensor) else None, tuple(p.shape))
                  for name, p in model.named_parameters()}
    split_dim = {"colwise": 0, "colwise_gather_output": 0, "embedding_rowwise": 0, "rowwise": -1, "packed_colwise": 1}
    plan, styles = KimiK3ForCausalLM(tiny_config()).tp_plan, set()
    for name, (local, full) in shapes.items():
        generic = replace_layer_number_by_wildcard(name)
        style = plan.get(generic) or plan[generic.rpartition(".")[0]]
        styles.add(style)
        if style in WHOLE_STYLES:
            assert local is None, name
            continue
        dim = split_dim[style] if len(full) > 1 else 0
        assert full[dim] % tp == 0, name
        expected = list(full)
        expected[dim] //= tp
        assert local == tuple(expected), name
    assert styles == set(split_dim) | set(WHOLE_STYLES) - {"local_params"}
    heads, kda_heads = config.num_attention_heads // tp, config.linear_num_heads // tp
    mla, kda = "model.layers.3.self_attn", "model.layers.1.self_attn"
    assert shapes[f"{mla}.q_b_proj.weight"][0][0] == heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    assert shapes[f"{mla}.kv_b_proj.weight"][0][0] == heads * (config.qk_nope_head_dim + config.v_head_dim)
    assert shapes[f"{kda}.A_log"][0] == (kda_heads,)
    assert shapes[f"{kda}.q_conv1d.weight"][0][0] == kda_heads * config.linear_head_dim


# ---------------------------------------------------------------------------------------------------------------------
# 2 processes against one
# ---------------------------------------------------------------------------------------------------------------------
def configs() -> dict[str, KimiK3Config]:
    """Two heads per rank in both attentions; the second model has MLA without the query LoRA (q_proj), a tied
    lm_head and the plain residual stream instead of Block Attention Residuals."""
    heads = {"num_attention_heads": 4, "linear_num_heads": 4}
    return {
        "k3": tiny_config(**heads),
        "plain": tiny_config(**heads, q_lora_rank=None, tie_word_embeddings=True, attn_res_block_size=None),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("tensor_parallel")
    for name, config in configs().items():
        torch.manual_seed(0)
        KimiK3ForCausalLM(config).save_pretrained(work / name)
    return {name: work / name for name in configs()}


@pytest.fixture(scope="module")
def launched(folders) -> dict[str, dict]:
    out = next(iter(folders.values())).parent
    torchrun(str(Path(scenario.__file__)), str(out), *map(str, folders.values()), nproc=WORLD_SIZE,
             timeout_s=LAUNCH_TIMEOUT_S)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in folders}


def single_process(folder: Path, dtype: torch.dtype = torch.float32, perturbation_seed: int | None = None) -> dict:
    model = KimiK3ForCausalLM.from_pretrained(folder).to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")  # grouped_mm kernels have no fp64 path
    if perturbation_seed is not None:
        perturb_parameters(model, perturbation_seed)
    ids = scenario.input_ids(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train()
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    model.eval()
    prompt = ids[:, : scenario.PROMPT_LENGTH]
    return {"logits": logits, "training_logits": output.logits.detach(), "loss": output.loss.detach(),
            "grads": {name: p.grad for name, p in model.named_parameters() if p.grad is not None},
            "generated": model.generate(prompt, max_new_tokens=scenario.NEW_TOKENS, do_sample=False)}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(configs()))
def test_two_rank_tensor_parallel_model_computes_what_one_process_does(name, folders, launched):
    """Inference and training forwards, the loss and all gradients are within fp32 rounding of a float64 run of the
    same model (each rank sums its half of every row-parallel product and the halves are added: another order of the
    same fp32 sums); greedy decoding through the hybrid cache (absorbed MLA, recurrent KDA on each rank's heads)
    picks the same tokens. The KDA decay gradients (``A_log``, ``dt_bias``) sum many terms with cancellation: their
    rounding error varies 40x between evaluation orders, which the perturbed float64 runs measure."""
    parallel, single = launched[name], single_process(folders[name])
    exact = single_process(folders[name], torch.float64)
    perturbed = [single_process(folders[name], torch.float64, seed) for seed in (1, 2)]
    assert parallel["world_size"] == WORLD_SIZE
    for key in ("logits", "training_logits", "loss"):
        assert_as_accurate(parallel[key], single[key], exact[key], [run[key] for run in perturbed], key)
    assert parallel["grads"].keys() == single["grads"].keys()
    for param, grad in single["grads"].items():
        assert_as_accurate(parallel["grads"][param], grad, exact["grads"][param],
                           [run["grads"][param] for run in perturbed], param)
    assert torch.equal(parallel["generated"], single["generated"])


@pytest.mark.distributed
def test_two_rank_tensor_parallel_model_holds_half_of_every_planned_matrix(launched):
    shapes = launched["k3"]["local_and_full_shapes"]
    kda, mla, moe = "model.layers.1.self_attn", "model.layers.3.self_attn", "model.layers.1.block_sparse_moe"
    halved_rows = [f"{kda}.{p}_proj.weight" for p in "qkvgb"] + [f"{kda}.{p}_conv1d.weight" for p in "qkv"]
    halved_rows += [f"{kda}.A_log", f"{kda}.dt_bias", f"{mla}.q_b_proj.weight", f"{mla}.kv_b_proj.weight",
                    f"{mla}.g_proj.weight", f"{moe}.shared_experts.up_proj.weight", "lm_head.weight",
                    "model.embed_tokens.weight"]
    for name in halved_rows:
        local, full = shapes[name]
        assert local == (-(-full[0] // WORLD_SIZE), *full[1:]), name
    for name in (f"{kda}.o_proj.weight", f"{mla}.o_proj.weight", f"{moe}.experts.down_proj"):
        local, full = shapes[name]
        assert local == (*full[:-1], full[-1] // WORLD_SIZE), name
    local, full = shapes[f"{moe}.experts.gate_up_proj"]
    assert local == (full[0], full[1] // WORLD_SIZE, full[2])
    for name in (f"{moe}.gate.weight", f"{moe}.routed_expert_down_proj.weight", f"{mla}.kv_a_proj_with_mqa.weight"):
        assert shapes[name][0] == shapes[name][1], name
