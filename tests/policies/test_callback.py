"""Policies update from the optimizer's step hooks, so Quantile Balancing and QK-Clip give the same model under
``Trainer`` (where callbacks only attach, log and detach) as in a plain ``torch`` loop, with any optimizer."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer, TrainingArguments

from kimi_k3.attachments.seams import find_routers
from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.policies.callback import report_after_every_callback
from kimi_k3.policies.qk_clip import QKClip, QKClipCallback
from kimi_k3.policies.quantile_balancing import QuantileBalancing, QuantileBalancingCallback
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config

STEPS, BATCH, TAU = 3, 4, 0.01  # the test model's max logits (~0.01-0.03) straddle tau = 0.01: some heads clip


def four_layer_config():
    """KDA, MLA, KDA, MLA, with routed experts: every policy has something to act on, at toy cost."""
    return tiny_config(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                       attn_res_block_size=2)


def token_rows(config) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(3, config.vocab_size, (STEPS * BATCH, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def new_model(config):
    torch.manual_seed(0)
    return KimiK3ForCausalLM(config).train()


# Newton–Schulz's precision forced both ways rather than picked from this CPU ("auto": bf16 where it is native).
OPTIMIZERS = {
    "per_head_muon, bf16 Newton–Schulz": dict(ns_dtype="bfloat16"),
    "per_head_muon, fp32 Newton–Schulz": dict(ns_dtype="float32"),
    "adamw": None,
}


def make_optimizer(name: str, model):
    if OPTIMIZERS[name] is not None:
        return PerHeadMuon.for_model(model, lr=1e-2, **OPTIMIZERS[name])
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_under_trainer(config, optimizer_name, tmp_path):
    model = new_model(config)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, train_sampling_strategy="sequential",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(config),
                      optimizers=(make_optimizer(optimizer_name, model), None),
                      callbacks=[QKClipCallback(TAU), QuantileBalancingCallback(model)])
    trainer.train()
    logs = [{key: value for key, value in entry.items() if key.startswith(("qk_clip/", "balance/"))}
            for entry in trainer.state.log_history if "loss" in entry]
    return model, logs


def train_in_a_plain_loop(config, optimizer_name):
    model = new_model(config)
    optimizer = make_optimizer(optimizer_name, model)
    clip, balancing = QKClip(model, TAU), QuantileBalancing(model)
    rows, logs = token_rows(config), []
    with clip.attach(optimizer), balancing.attach(optimizer):
        for step in range(STEPS):
            batch = {key: torch.stack([row[key] for row in rows[step * BATCH : (step + 1) * BATCH]]) for key in rows[0]}
            # The loss as Trainer asks the model for it: summed over the predicted tokens, divided by their count.
            model(**batch, num_items_in_batch=(batch["labels"][:, 1:] != -100).sum()).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            logs.append({**clip.latest_metrics, **balancing.latest_metrics})
    return model, logs


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_quantile_balancing_and_qk_clip_act_the_same_in_a_plain_loop_and_under_trainer(optimizer_name, tmp_path):
    config = four_layer_config()
    under_trainer, trainer_logs = train_under_trainer(config, optimizer_name, tmp_path)
    in_a_loop, loop_logs = train_in_a_plain_loop(config, optimizer_name)
    assert trainer_logs == loop_logs and len(loop_logs) == STEPS
    assert any(entry["qk_clip/clipped_heads"] > 0 for entry in loop_logs)  # the clip acted
    assert all(router.e_score_correction_bias.abs().max() > 0 for router in find_routers(in_a_loop).values())
    expected = in_a_loop.state_dict()
    for name, tensor in under_trainer.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # Detached at the end of training, as the plain loop's attachments are at the end of their `with`.
    for model in (under_trainer, in_a_loop):
        assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def tensorboard_scalars(folder) -> dict[str, list[float]]:
    """Every scalar series of the TensorBoard event files in ``folder``, read back by TensorBoard's own reader."""
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def tensorboard_trainer(config, folder, callbacks=lambda model: []):
    model = new_model(config)
    args = TrainingArguments(
        output_dir=str(folder), max_steps=STEPS, per_device_train_batch_size=BATCH, logging_steps=1,
        save_strategy="no", report_to="tensorboard", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    return model, Trainer(model=model, args=args, train_dataset=token_rows(config), callbacks=callbacks(model))


@pytest.mark.parametrize("registration", ["callback.attach(trainer)", "report_after_every_callback(trainer)"])
def test_plain_trainer_reports_balance_and_qk_clip_metrics_to_tensorboard(registration, tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "events"))
    policies = lambda model: [QKClipCallback(TAU), QuantileBalancingCallback(model)]  # noqa: E731
    if registration == "callback.attach(trainer)":
        model, trainer = tensorboard_trainer(four_layer_config(), tmp_path)
        for callback in policies(model):
            callback.attach(trainer)
    else:
        model, trainer = tensorboard_trainer(four_layer_config(), tmp_path, policies)
        report_after_every_callback(trainer)
    trainer.train()
    scalars = tensorboard_scalars(tmp_path / "events")
    train_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(train_logs) == STEPS
    for key in ("balance/max_vio", "balance/cv", "qk_clip/max_logit", "qk_clip/clipped_heads"):
        assert scalars[f"train/{key}"] == pytest.approx([entry[key] for entry in train_logs], rel=1e-6)


def test_callbacks_passed_to_trainer_behind_its_integrations_warn_that_reporting_misses_their_metrics(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "events"))
    model, trainer = tensorboard_trainer(four_layer_config(), tmp_path)
    trainer.add_callback(QuantileBalancingCallback(model))
    with pytest.warns(UserWarning, match=r"QuantileBalancingCallback's metrics .* not report_to \['tensorboard'\]"):
        trainer.train()
    assert "train/balance/max_vio" not in tensorboard_scalars(tmp_path / "events")
