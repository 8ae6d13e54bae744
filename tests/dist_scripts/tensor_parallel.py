"""Tensor parallelism by ``KimiK3Config.base_model_tp_plan``, on every rank of a ``torchrun`` launch (gloo on CPUs).

Launched as ``torchrun --nproc_per_node 2 tests/dist_scripts/tensor_parallel.py OUT FOLDER...``: every rank loads
each saved model folder through the Auto classes as remote code with ``tp_plan="auto"``, then runs an inference
forward (transformers' local-tensor path), a training forward and backward (its DTensor path) and a greedy
generation with the hybrid cache. Rank 0 writes, per folder, the logits, the loss, every parameter's full gradient,
the generated tokens and every parameter's local and full shape to ``OUT/<folder name>.pt``; the test compares them
with one process.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

BATCH, SEQUENCE_LENGTH, PROMPT_LENGTH, NEW_TOKENS = 2, 12, 5, 6


def input_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(vocab_size, (BATCH, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(0))


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run(folder: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", trust_remote_code=True)
    ids = input_ids(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train()
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    model.eval()
    generated = model.generate(ids[:, :PROMPT_LENGTH], max_new_tokens=NEW_TOKENS, do_sample=False)
    shapes = {
        name: (tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape), tuple(p.shape))
        for name, p in model.named_parameters()
    }
    return {"logits": logits, "training_logits": output.logits.detach(), "loss": output.loss.detach(),
            "grads": grads, "generated": generated, "local_and_full_shapes": shapes}


def main(out: Path, folders: list[Path]) -> None:
    for folder in folders:
        result = run(folder)
        if dist.get_rank() == 0:
            torch.save({**result, "world_size": dist.get_world_size()}, out / f"{folder.name}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]])
