import pytest

from kimi_k3.job import main
from kimi_k3.job.arguments import UsageError, check_balancing, parse_args
from kimi_k3.policies.auxiliary_balance_loss import AuxiliaryBalanceLossCallback
from kimi_k3.policies.quantile_balancing import QuantileBalancingCallback
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config


def parsed(*argv: str):
    return parse_args(["--output_dir", "unused", *argv])


def test_router_balancing_defaults_to_quantile_and_no_quantile_balancing_means_none():
    assert parsed()[0].router_balancing == "quantile"
    model_args = parsed("--no_quantile_balancing")[0]
    assert model_args.router_balancing == "none" and not model_args.quantile_balancing
    assert not parsed("--router_balancing", "sign")[0].quantile_balancing
    with pytest.raises(UsageError, match="^--no_quantile_balancing leaves the router bias alone, and "
                                         "--router_balancing sign moves it: pass one of them$"):
        parsed("--no_quantile_balancing", "--router_balancing", "sign")


@pytest.mark.parametrize("argv, message", [
    (["--aux_loss_alpha", "-1"], "--aux_loss_alpha must be a finite number >= 0, got -1.0"),
    (["--sign_balancing_gamma", "nan"], "--sign_balancing_gamma must be a finite number >= 0, got nan"),
    (["--router_balancing", "sign", "--sign_balancing_gamma", "0"], "--router_balancing sign needs "
                                                                     "--sign_balancing_gamma > 0"),
])  # fmt: skip
def test_bad_balancing_values_are_refused_naming_the_flag(argv, message):
    with pytest.raises(UsageError, match=f"^{message}"):
        check_balancing(parsed(*argv)[0])


def test_options_attach_the_sign_rule_the_auxiliary_loss_per_micro_batch_and_whole_matrix_muon():
    model = KimiK3ForCausalLM(tiny_config())
    model_args, _, _, training_args = parsed(
        "--router_balancing", "sign", "--sign_balancing_gamma", "2e-3", "--aux_loss_alpha", "1e-2",
        "--optimizer", "whole_matrix_muon", "--gradient_accumulation_steps", "4",
    )
    (factory, kwargs), callbacks = main.optimizer_and_callbacks(model_args, training_args, model, None)
    balancing = next(callback.policy for callback in callbacks if isinstance(callback, QuantileBalancingCallback))
    assert (balancing.update_rule, balancing.sign_gamma) == ("sign", 2e-3)
    auxiliary = next(callback.policy for callback in callbacks if isinstance(callback, AuxiliaryBalanceLossCallback))
    assert auxiliary.alpha == pytest.approx(1e-2 / 4)  # Trainer sums the 4 micro-batches' losses of a step
    optimizer = factory()(model, **kwargs)
    assert kwargs["per_head"] is False and {group.get("head_rows") for group in optimizer.param_groups} == {None}


def test_auxiliary_loss_on_a_model_without_experts_is_refused_naming_the_flag():
    model = KimiK3ForCausalLM(tiny_config(num_experts=None))
    model_args, _, _, training_args = parsed("--aux_loss_alpha", "1e-4")
    with pytest.raises(UsageError, match="^--aux_loss_alpha balances MoE routers, and the model has none"):
        main.optimizer_and_callbacks(model_args, training_args, model, None)
