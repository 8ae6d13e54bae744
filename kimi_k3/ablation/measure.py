"""What one finished run of the matrix measured: read from its checkpoint (training curves, time) and from one pass of
its final model over the job's validation blocks (loss, dead experts, the largest activation inside the routed experts,
the largest attention logit).

The evaluation pass runs every model the same way, whatever the row trained with: eval loss is the token-mean
cross-entropy over all validation blocks, and the maxima are over the same real tokens and causal pairs.
"""

import json
import math
from pathlib import Path

import datasets
import torch
from transformers.trainer_utils import get_last_checkpoint

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.attachments.handle import Attachment
from kimi_k3.attachments.padding import masked_counts, shared_padding
from kimi_k3.attachments.seams import experts_activation, find_expert_modules, find_mla_layers, find_routers
from kimi_k3.job.final_save import FINAL_MODEL_DIR
from kimi_k3.job.run_settings import RUN_SETTINGS_FILE
from kimi_k3.policies.balance_metrics import load_balance_metrics
from kimi_k3.policies.qk_clip import LogitMaxRecorder
from kimi_k3.publishing.model_card import parameter_counts
from kimi_k3.text.corpus import evaluation_blocks, load_corpus, tokenize_into_blocks
from kimi_k3.text.tokenizer import load_tokenizer
from modeling_kimi_k3 import KimiK3ForCausalLM
from variants_kimi_k3 import causal_lm_class

EVAL_BATCH = 16


def validation_blocks(data_files: list[str] | None, tokenizer, block_size: int, max_eval_samples: int | None):
    """The job's validation blocks (`kimi_k3.job.main`: the same split, packing and limit)."""
    splits, _ = load_corpus(data_files, "text", 5.0)
    blocks = tokenize_into_blocks(datasets.DatasetDict({"validation": splits["validation"]}), tokenizer, block_size)
    return evaluation_blocks(blocks["validation"], max_eval_samples)


def training_record(run_dir: Path) -> dict:
    """Curves and times from the run's last checkpoint: loss and MaxVio at every logged step, and the job's clock."""
    checkpoint = get_last_checkpoint(str(run_dir))
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    logged = [entry for entry in state["log_history"] if "loss" in entry]
    clock = state["stateful_callbacks"]["TrainingClock"]["attributes"]
    max_vio = [entry["balance/max_vio"] for entry in logged if "balance/max_vio" in entry]
    return {
        "steps": state["global_step"],
        "loss_curve": [[entry["step"], entry["loss"]] for entry in logged],
        "max_vio_curve": [[entry["step"], entry["balance/max_vio"]] for entry in logged if "balance/max_vio" in entry],
        "final_train_loss": logged[-1]["loss"] if logged else math.nan,
        "final_max_vio": max_vio[-1] if max_vio else math.nan,
        "mean_max_vio": sum(max_vio) / len(max_vio) if max_vio else math.nan,
        "step_time_s": clock["step_s"] / clock["steps"] if clock.get("steps") else math.nan,
        "wall_time_s": clock["earlier_s"],
        "resumed_at": clock["resumed_at"],
    }


class _Maxima:
    """Running max |x| of named module outputs, as forward hooks."""

    def __init__(self):
        self.values: dict[str, float] = {}

    def hook(self, name: str):
        def record(module, args, output) -> None:
            value = output.detach().abs().max().item()
            self.values[name] = max(self.values.get(name, 0.0), value)

        return record


def _route_counter(load: torch.Tensor):
    """A router hook adding its routes to ``load`` (masked_counts drops dynamic k's unused slots, index n)."""

    def count(router, args, outputs) -> None:
        load.add_(masked_counts(outputs[2].cpu(), None, router.num_experts))

    return count


@torch.no_grad()
def evaluation_record(model: KimiK3ForCausalLM, blocks) -> dict:
    """Token-mean eval loss and perplexity, dead experts over all MoE layers, and the largest |activation| of the
    routed experts (their GLU output, and their combined latent output before the latent norm) and MLA logit."""
    maxima, attachment = _Maxima(), Attachment("ablation measurement")
    routers = find_routers(model)
    loads = {name: torch.zeros(router.num_experts, dtype=torch.long) for name, router in routers.items()}
    with attachment:
        padding = shared_padding(model, attachment)
        logit_maxima = {}
        for name, attn in find_mla_layers(model).items():
            logit_maxima[name] = LogitMaxRecorder(attn, padding, training_only=False)
            attachment.set_attribute(attn, "query_key_observer", logit_maxima[name])
        for experts in find_expert_modules(model).values():
            attachment.add(experts_activation(experts).register_forward_hook(maxima.hook("expert_activation")))
            attachment.add(experts.register_forward_hook(maxima.hook("expert_output")))
        for name, router in routers.items():
            attachment.add(router.register_forward_hook(_route_counter(loads[name])))
        loss_sum, tokens = _cross_entropy_sum(model, blocks)
    dead = sum(load_balance_metrics(loads[name], router.e_score_correction_bias).get("dead_experts", 0)
               for name, router in routers.items())
    logit = max((recorder.maximum.max().item() for recorder in logit_maxima.values()), default=math.nan)
    return {
        "eval_loss": loss_sum / tokens,
        "eval_perplexity": math.exp(loss_sum / tokens),
        "dead_experts": dead,
        "max_expert_activation": maxima.values.get("expert_activation", math.nan),
        "max_expert_output": maxima.values.get("expert_output", math.nan),
        "max_attention_logit": logit,
    }


def _cross_entropy_sum(model, blocks) -> tuple[float, int]:
    model.eval()
    loss_sum, tokens = 0.0, 0
    inputs = [name for name in ("input_ids", "position_ids") if name in blocks.column_names]
    for start in range(0, len(blocks), EVAL_BATCH):
        batch = blocks[start : start + EVAL_BATCH]
        labels = torch.tensor(batch["labels"])
        predicted = int((labels[:, 1:] != -100).sum())
        out = model(**{name: torch.tensor(batch[name]) for name in inputs}, labels=labels, use_cache=False)
        loss_sum += out.loss.item() * predicted
        tokens += predicted
    return loss_sum, tokens


def measure_run(run_dir: Path, data_files: list[str] | None, block_size: int, max_eval_samples: int | None) -> dict:
    """Everything the report shows of one run, from its folder."""
    model_dir = run_dir / FINAL_MODEL_DIR
    model = causal_lm_class(KimiK3Config.from_pretrained(model_dir)).from_pretrained(model_dir)
    blocks = validation_blocks(data_files, load_tokenizer(str(model_dir)), block_size, max_eval_samples)
    record = training_record(run_dir) | evaluation_record(model, blocks)
    counts = parameter_counts(model)
    record |= {"total_parameters": counts["total"], "active_parameters": counts["active"]}
    record["tokens_per_s"] = _tokens_per_step(run_dir) / record["step_time_s"]
    return record


def _tokens_per_step(run_dir: Path) -> int:
    """Tokens of one optimizer step of a one-process run without gradient accumulation, as the matrix runs them."""
    checkpoint = Path(get_last_checkpoint(str(run_dir)))
    batch = json.loads((checkpoint / "trainer_state.json").read_text())["train_batch_size"]
    return batch * json.loads((checkpoint / RUN_SETTINGS_FILE).read_text())["block_size"]
