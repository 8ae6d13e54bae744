"""Expert merging (kimi_k3/policies/expert_merging.py): merging two equal experts changes only the tokens routed to the
re-initialised slot, the optimizer state of both slots is reset, and a run resumed after a merge is bit-exact."""

import copy
import json

import pytest
import torch

from kimi_k3.attachments.padding import masked_counts
from kimi_k3.policies.expert_merging import ExpertMergingCallback, merge_similar_experts, most_similar_pairs
from kimi_k3.policies.quantile_balancing import QuantileBalancing
from tests.job.test_train import callback_states, run_interrupted, run_main, tiny_args, weights, write_corpus
from tests.test_variants import variant_model


def make_experts_equal(layer, copy_from: int, copy_to: int) -> None:
    experts = layer.block_sparse_moe.experts
    names = ["gate_up_coefficients", "down_coefficients"] if hasattr(experts, "gate_up_coefficients") else [
        "gate_up_proj", "down_proj"]
    with torch.no_grad():
        for name in names:
            getattr(experts, name)[copy_to] = getattr(experts, name)[copy_from]


@pytest.mark.parametrize("fields", [{}, {"expert_basis_size": 4, "attention_gate_routing": True}],
                         ids=["released experts", "shared basis + attention gate"])
def test_merging_two_equal_experts_changes_only_the_tokens_routed_to_the_reinitialised_slot(fields):
    model = variant_model(**fields)
    layer = model.model.layers[3]  # an MLA layer: with the attention gate, its column of U is split too
    make_experts_equal(layer, copy_from=2, copy_to=5)
    moe = layer.block_sparse_moe
    with torch.no_grad():  # routes that depend on the token, so that each expert gets about its share
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=torch.Generator().manual_seed(2)))
    unmerged = copy.deepcopy(moe)
    tokens = torch.randn(400, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        routes_before = moe.gate(tokens)[2]
        loads = masked_counts(routes_before, None, 8)
        (merge,) = merge_similar_experts(layer, loads, similarity_threshold=0.999, max_merges=1,
                                         generator=torch.Generator().manual_seed(0))
        routes_after = moe.gate(tokens)[2]
        assert {merge["kept"], merge["merged"]} == {2, 5} and merge["similarity"] > 0.999
        freed, source = merge["merged"], merge["split_from"]
        exempt = (routes_before == freed).any(-1) | (routes_after == freed).any(-1)
        assert exempt.any() and (~exempt).sum() > 100
        # The same batch of the other tokens, before and after (grouped GEMMs round by the batch they see).
        assert torch.equal(moe(tokens[~exempt]), unmerged(tokens[~exempt]))
        assert not torch.allclose(moe(tokens[exempt]), unmerged(tokens[exempt]))
    assert torch.equal(moe.gate.weight[freed], moe.gate.weight[source])
    assert moe.gate.e_score_correction_bias[freed] == moe.gate.e_score_correction_bias[source]
    experts = moe.experts
    assert not torch.equal(experts.gate_up_proj[freed], experts.gate_up_proj[source])  # a copy plus noise
    torch.testing.assert_close(experts.gate_up_proj[freed], experts.gate_up_proj[source], rtol=0.1, atol=1e-3)
    if fields:
        routing_weight = layer.self_attn.g_proj.routing_weight
        assert torch.equal(routing_weight[:, freed], routing_weight[:, source])


def test_merge_resets_the_optimizer_state_of_both_slots_and_keeps_the_others():
    model = variant_model().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 97, (2, 12))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    layer = model.model.layers[1]
    make_experts_equal(layer, copy_from=0, copy_to=6)
    expert_tensor = layer.block_sparse_moe.experts.gate_up_proj
    before = optimizer.state[expert_tensor]["exp_avg"].clone()
    (merge,) = merge_similar_experts(layer, torch.ones(8), 0.999, 1, torch.Generator().manual_seed(0), optimizer)
    state = optimizer.state[expert_tensor]["exp_avg"]
    touched = [merge["kept"], merge["merged"]]
    assert state[touched].abs().max() == 0 and before[touched].abs().max() > 0
    untouched = [e for e in range(8) if e not in touched]
    assert torch.equal(state[untouched], before[untouched])
    router_state = optimizer.state[layer.block_sparse_moe.gate.weight]["exp_avg_sq"]
    assert router_state[touched].abs().max() == 0 and router_state[untouched].abs().min(-1).values.max() > 0


def test_pairs_are_disjoint_most_similar_first_and_above_the_threshold():
    similarity = torch.tensor([[1.0, 0.9, 0.2, 0.3], [0.9, 1.0, 0.95, 0.1], [0.2, 0.95, 1.0, 0.8], [0.3, 0.1, 0.8, 1.0]])
    pairs = most_similar_pairs(similarity, 0.5, 3)
    assert [(i, j) for i, j, _ in pairs] == [(1, 2)]  # 0-3 (0.3) is below the threshold; 0-1 and 2-3 reuse an expert
    assert [(i, j) for i, j, _ in most_similar_pairs(similarity, 0.2, 3)] == [(1, 2), (0, 3)]


def test_callback_needs_the_step_loads_and_refuses_impossible_settings():
    model = variant_model()
    balancing = QuantileBalancing(model)
    with pytest.raises(ValueError, match="similarity_threshold is a cosine similarity in \\[-1, 1\\], got 2"):
        ExpertMergingCallback(balancing, every_n_steps=5, similarity_threshold=2.0)
    with pytest.raises(ValueError, match="every_n_steps must be an integer >= 1, got 0"):
        ExpertMergingCallback(balancing, every_n_steps=0, similarity_threshold=0.5)
    with pytest.raises(ValueError, match="needs Quantile Balancing's loads of this step"):
        ExpertMergingCallback(balancing, every_n_steps=1, similarity_threshold=-1.0).merge(model, step=1)


MERGING = ["--expert_merging_every_n_steps", "2", "--expert_merging_threshold", "-1", "--expert_merging_max_per_layer",
           "2"]


def test_a_run_resumed_after_merges_ends_bit_exactly_as_the_uninterrupted_run(tmp_path):
    corpus = write_corpus(tmp_path)
    assert run_main(tiny_args(tmp_path / "straight", corpus, *MERGING))[0] == 0
    run_interrupted(tiny_args(tmp_path / "resumed", corpus, *MERGING), global_step=5)  # merged at steps 2 and 4
    history = callback_states(tmp_path / "resumed" / "checkpoint-4")["ExpertMergingCallback"]["attributes"]["history"]
    assert [merge["step"] for merge in history] == [2] * 16 + [4] * 16  # 8 MoE layers, 2 merges each
    assert run_main(tiny_args(tmp_path / "resumed", corpus, *MERGING, "--resume_from_checkpoint", "True"))[0] == 0
    expected, resumed = weights(tmp_path / "straight" / "model"), weights(tmp_path / "resumed" / "model")
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)
    final = callback_states(tmp_path / "resumed" / "checkpoint-8")["ExpertMergingCallback"]["attributes"]["history"]
    straight = callback_states(tmp_path / "straight" / "checkpoint-8")["ExpertMergingCallback"]["attributes"]["history"]
    assert final == straight and len(final) == 4 * 16
    logs = json.loads((tmp_path / "straight" / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    assert [entry["expert_merging/merges"] for entry in logs if "expert_merging/merges" in entry] == [16.0] * 4
