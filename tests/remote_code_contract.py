"""What a saved Kimi K3 folder promises under whatever transformers its users install, checked with nothing else.

A folder on the hub carries its model code and runs as remote code under transformers releases published long after
it was saved. CI runs this contract under the newest transformers on the package index, in a venv holding only torch,
transformers and what ``Trainer`` needs (accelerate):

    python tests/remote_code_contract.py save WORK        # with this project installed: the folders and their outputs
    VENV/bin/python -I tests/remote_code_contract.py check WORK   # a fresh, isolated process: no project on the path

``check`` loads the causal-LM folder and the base-model folder through the Auto classes with ``trust_remote_code``,
requires their outputs to equal the saved ones bit for bit, cached greedy generation to equal greedy decoding by full
forwards, three ``Trainer`` steps to train, and the trained model to save and reload with the same outputs. ``check``
imports only torch, safetensors and transformers; it runs in ``python -I`` so nothing of the checkout is importable.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NEW_TOKENS = 6
TRAINER_STEPS = 3


def save(work: Path) -> None:
    """The tiny test model as a causal-LM folder and a base-model folder, with the outputs both must reproduce."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from modeling_kimi_k3 import KimiK3ForCausalLM
    from tests.conftest import tiny_config

    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config(pad_token_id=0, eos_token_id=None)).eval()
    model.save_pretrained(work / "causal_lm")
    model.model.save_pretrained(work / "base")
    input_ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = {
            "input_ids": input_ids,
            "logits": model(input_ids).logits,
            "hidden_states": model.model(input_ids).last_hidden_state,
            "generated": model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0),
        }
    save_file(expected, str(work / "expected.safetensors"))


def check(work: Path) -> None:
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    print(f"remote-code contract under transformers {transformers.__version__}, torch {torch.__version__}")
    expected = load_file(str(work / "expected.safetensors"))
    input_ids = expected["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(work / "causal_lm", trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(work / "base", trust_remote_code=True).eval()
    for loaded in (model, base):
        assert type(loaded).__module__.startswith("transformers_modules."), type(loaded).__module__
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, expected["logits"]), "causal-LM logits differ from the saved ones"
        assert torch.equal(base(input_ids).last_hidden_state, expected["hidden_states"]), "base outputs differ"
        generated = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, expected["generated"]), "cached generation differs from the saved one"
    assert torch.equal(generated, greedy_by_full_forwards(model, input_ids)), "cached generation differs from uncached"
    train_and_reload(model, input_ids, work / "trained")
    print("remote-code contract: ok")


def greedy_by_full_forwards(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            next_token = model(input_ids, use_cache=False).logits[:, -1:].argmax(-1)
            input_ids = torch.cat([input_ids, next_token], dim=1)
    return input_ids


def train_and_reload(model, input_ids: torch.Tensor, output_dir: Path) -> None:
    """Three ``Trainer`` steps move the weights with finite losses; the saved result reloads with the same logits."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    rows = [{"input_ids": row, "labels": row} for row in input_ids.repeat(3, 1)]
    args = TrainingArguments(output_dir=str(output_dir), max_steps=TRAINER_STEPS, per_device_train_batch_size=2,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=model.train(), args=args, train_dataset=rows)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == TRAINER_STEPS and all(torch.isfinite(torch.tensor(losses))), losses
    assert any(not torch.equal(before[name], tensor) for name, tensor in model.state_dict().items()), "nothing trained"
    model.eval().save_pretrained(output_dir / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir / "model", trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, model(input_ids).logits), "the reloaded model computes otherwise"


if __name__ == "__main__":
    command, folder = sys.argv[1], Path(sys.argv[2])
    {"save": save, "check": check}[command](folder)
