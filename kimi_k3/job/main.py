"""Pre-train or fine-tune a Kimi K3 model with ``transformers.Trainer``: ``kimi-k3-train`` / ``python -m kimi_k3.job``.

``main`` reads top-down: arguments -> data -> tokenizer -> model -> optimizer and callbacks -> Trainer -> save, card,
push. The defaults train the default ``KimiK3Config()`` on the embedded corpus in a few minutes on a 2-core CPU with
Per-Head Muon, Quantile Balancing and QK-Clip. Every ``TrainingArguments`` option can be given on the command line.
The parts: `kimi_k3.job.arguments` (options and checks), `kimi_k3.job.trainer` (the Trainer subclass),
`kimi_k3.job.final_save` (the final folder, card and report).
"""

import sys
import time
from pathlib import Path

import datasets
from accelerate.utils import broadcast_object_list
from huggingface_hub.errors import StrictDataclassError
from transformers import TrainerState, TrainingArguments, default_data_collator, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.attachments.seams import find_routed_experts, find_routers
from kimi_k3.checkpoint import run_folder
from kimi_k3.checkpoint.finite import first_non_finite
from kimi_k3.checkpoint.release_format import check_exportable
from kimi_k3.job import expert_load
from kimi_k3.job.allocator import allocator_description
from kimi_k3.job.threads import choose_intra_op_threads
from kimi_k3.job.arguments import (
    ModelArguments,
    UsageError,
    card_settings,
    check_batch_sizes,
    check_block_size,
    check_balancing,
    check_expert_merging,
    check_data_limits,
    check_learning_rate,
    check_local_sources,
    check_world_size,
    config_overrides,
    parse_args,
    parse_qk_clip_tau,
    publish_settings,
    resolve_checkpoint,
)
from kimi_k3.job.expert_load import ExpertLoadRecorder
from kimi_k3.job.health import TrainingDiverged, check_finite_metric, check_finite_weights
from kimi_k3.job.launch import announce_parallelism
from kimi_k3.job.final_save import (
    FINAL_MODEL_DIR,
    expert_load_picture,
    holds_final_model,
    local_folder_name,
    measure_expert_load,
    print_report,
    save_final_model,
    training_summary,
    weights_as_evaluated,
    write_file_atomically,
)
from kimi_k3.job.resources import check_model_fits_memory
from kimi_k3.job.resume_manifest import CheckpointFileError, check_trainer_files, first_line
from kimi_k3.job.run_settings import check_unchanged, run_settings
from kimi_k3.job.resumable import TrainingClock
from kimi_k3.policies.callback import ResumableCallback
from kimi_k3.job.trainer import KimiK3Trainer, SaveError, check_resumable, finished_step
from kimi_k3.kernels.subnormals import flush_subnormals
from kimi_k3.kernels.training import use_fused_kernels
from kimi_k3.optim.muon import PerHeadMuonFactory
from kimi_k3.optim.precision import warn_if_bf16_is_emulated
from kimi_k3.policies.auxiliary_balance_loss import AuxiliaryBalanceLossCallback
from kimi_k3.policies.expert_merging import ExpertMergingCallback
from kimi_k3.policies.qk_clip import QKClipCallback
from kimi_k3.policies.quantile_balancing import QuantileBalancingCallback
from kimi_k3.publishing import hub
from kimi_k3.publishing.model_card import render_model_card
from kimi_k3.quantization.qat import WEIGHT_FORMATS, attach_qat, check_mxfp4_widths
from kimi_k3.text.corpus import DataError, evaluation_blocks, load_corpus, tokenize_into_blocks, tokenizer_documents
from kimi_k3.text.tokenizer import check_tokenizer_fits, load_tokenizer, train_bpe_tokenizer
from modeling_kimi_k3 import KimiK3ForCausalLM
from variants_kimi_k3 import causal_lm_class


def flush_subnormals_or_refuse() -> None:
    try:
        flush_subnormals()
    except RuntimeError as error:
        raise UsageError(f"--flush_subnormals: {error}") from None


def main(argv: list[str] | None = None) -> int:
    """Run the job. Bad input exits with status 2 and a one-line message, before anything is written (a bad row deep
    in a stream: when it is read); a failed save exits with status 1 and a one-line message, publishing nothing
    partial."""
    start = time.perf_counter()
    datasets.disable_progress_bars()
    lock = None
    try:
        try:
            model_args, data_args, card_args, training_args = parse_args(argv)
            check_options(model_args, data_args, training_args)
            qk_clip_tau = parse_qk_clip_tau(model_args.qk_clip_tau)
            run_folder.check_output_folder(training_args.output_dir)
            publish = publish_settings(training_args)
            metadata = card_settings(card_args, model_args, data_args)
            lock = claim_output_folder(training_args)
            checkpoint = resolve_checkpoint(training_args)
            if checkpoint is not None:
                check_trainer_files(checkpoint, training_args, model_args.reinitialize_missing_trainer_state)
            threads = choose_intra_op_threads()  # before data loading starts threads of its own
            set_seed(training_args.seed)  # Trainer seeds only in its constructor, after the model is initialised
            if model_args.flush_subnormals:
                flush_subnormals_or_refuse()

            splits, data_description = load_corpus(
                data_args.data_files, data_args.text_column, data_args.validation_split_percentage,
                dataset_name=data_args.dataset_name, dataset_config_name=data_args.dataset_config_name,
                streaming=data_args.streaming,
            )
            tokenizer, model, settings = build_checked_model(
                model_args, data_args, training_args, splits["train"], checkpoint, qk_clip_tau
            )
            blocks = tokenize_into_blocks(splits, tokenizer, data_args.block_size, data_args.packing)
            blocks = {"train": blocks["train"], "validation": evaluation_blocks(blocks["validation"],
                                                                                data_args.max_eval_samples)}
            optimizer_cls_and_kwargs, callbacks = optimizer_and_callbacks(model_args, training_args, model, qk_clip_tau)
            callbacks.append(TrainingClock(start))
            trainer = build_trainer(model, tokenizer, blocks, training_args, optimizer_cls_and_kwargs, callbacks,
                                    settings)
            announce_parallelism(trainer)
            if trainer.is_world_process_zero():
                print(f"kimi-k3-train: {allocator_description()}")
                print(f"kimi-k3-train: {threads}")
        except ValueError as error:
            print(f"kimi-k3-train: error: {error}", file=sys.stderr)
            return 2
        except StrictDataclassError as error:  # KimiK3Config's checks: the error's cause is one line naming the field
            print(f"kimi-k3-train: error: model config: {error.__cause__ or error}", file=sys.stderr)
            return 2
        try:
            return run(trainer, model_args, data_args, blocks, data_description, checkpoint, publish, metadata)
        except (DataError, CheckpointFileError) as error:  # a stream is checked as it is read, Trainer state as loaded
            print(f"kimi-k3-train: error: {error}", file=sys.stderr)
            return 2
        except (SaveError, TrainingDiverged) as error:
            print(f"kimi-k3-train: error: {error}", file=sys.stderr)
            return 1
    finally:
        if lock is not None:  # also removes the folder when it was created here and nothing was written
            lock.release()


def build_checked_model(model_args, data_args, training_args, train_split, checkpoint, qk_clip_tau):
    """Tokenizer, model and the run's recorded settings, checked against the data options and, on a resume, against
    the checkpoint (its tensors and the settings it recorded)."""
    tokenizer = build_tokenizer(model_args, train_split, checkpoint)
    model = build_model(model_args, tokenizer, checkpoint, qk_clip_tau)
    attach_expert_qat(model_args, model)
    check_block_size(data_args.block_size, model.config)
    tokenizer.model_max_length = model.config.max_position_embeddings  # saved: truncation=True fits the model
    settings = run_settings(model_args, data_args, training_args, model.config)
    if checkpoint is not None:
        check_resumable(model, checkpoint, training_args)
        check_unchanged(checkpoint, settings, model.config)
    return tokenizer, model, settings


def check_options(model_args, data_args, training_args) -> None:
    """The checks of the options alone, before anything is read or written."""
    check_batch_sizes(training_args)
    check_learning_rate(training_args)
    check_local_sources(model_args)
    check_balancing(model_args)
    check_expert_merging(model_args)
    check_data_limits(data_args, training_args)
    check_world_size(training_args)
    warn_if_bf16_is_emulated(training_args.bf16, training_args.device)


def evaluation_at_last_step(state: TrainerState) -> dict[str, float] | None:
    """The metrics of an evaluation the Trainer already ran at the final step (``max_steps`` a multiple of
    ``eval_steps``), so that the same weights are not evaluated twice."""
    for entry in reversed(state.log_history):
        if "eval_loss" in entry:
            return entry if entry.get("step") == state.global_step else None
    return None


def run(trainer, model_args, data_args, blocks, data_description, checkpoint, publish, metadata) -> int:
    """Train (or, when the checkpoint already ends the run, only load it), evaluate, then save the final model."""
    training_args = trainer.args
    model_dir = Path(training_args.output_dir) / FINAL_MODEL_DIR
    finished = finished_step(checkpoint, training_args)
    if finished is None:
        trainer.train(resume_from_checkpoint=checkpoint)
    elif holds_final_model(Path(checkpoint), model_dir):
        print(f"kimi-k3-train: the run already finished at step {finished} and {model_dir} holds its model; nothing to do")
        return 0
    else:  # killed while saving the final model: finish from the last checkpoint without training a step
        trainer._load_from_checkpoint(checkpoint)
        trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, ResumableCallback):
                callback.resume_from(trainer.state)
    eval_metrics = evaluation_at_last_step(trainer.state) or trainer.evaluate()
    check_finite_metric(eval_metrics, "eval_loss")
    if not trainer.is_world_process_zero():
        return 0
    check_finite_weights(trainer.model.named_parameters(), str(model_dir))

    layer_balance = measure_expert_load(trainer.model, blocks["validation"], training_args.per_device_eval_batch_size)
    summary = training_summary(trainer, model_args, data_description, blocks, data_args.block_size, eval_metrics,
                               data_args.packing)
    name = publish.repo_id if publish else Path(training_args.output_dir).name
    picture = expert_load_picture(trainer, name)
    card = render_model_card(trainer.model, name, summary, layer_balance, metadata,
                             expert_load.PNG_NAME if picture else None,
                             local_folder=None if publish else local_folder_name(model_dir))
    with weights_as_evaluated(model_args, trainer.model):
        model_dir = save_final_model(
            trainer.model, trainer.processing_class, card, model_dir, trainer.staging_tag, model_args.final_layout,
            {expert_load.PNG_NAME: picture} if picture else None, final_checkpoint(trainer),
        )
    if picture:
        write_file_atomically(model_dir.parent / expert_load.PNG_NAME, picture, trainer.staging_tag)
    print_report(summary, model_dir)
    if publish:
        try:
            pushed = hub.push_folder(model_dir, publish.repo_id, hub.HfApi(token=publish.token),
                                     private=publish.private, revision=publish.revision)
        except hub.HubError as error:
            print(f"kimi-k3-train: error: {error}; {model_dir} is saved: publish it with "
                  f"`kimi-k3-push {model_dir} --hub_model_id {publish.repo_id}`", file=sys.stderr)
            return 1
        print(f"pushed {model_dir} to {pushed}")
    return 0


def final_checkpoint(trainer) -> Path | None:
    """The checkpoint Trainer saved at the last step, which the final model is made from."""
    checkpoint = Path(trainer.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    return checkpoint if checkpoint.is_dir() else None


def claim_output_folder(training_args: TrainingArguments) -> run_folder.OutputFolderLock | None:
    """Lock --output_dir for this job (on the first process; every rank learns the outcome), then undo what a killed
    job left half done there. Everything the job decides from the folder's contents comes after this."""
    lock, refusal = None, None
    if training_args.process_index == 0:
        try:
            lock = run_folder.OutputFolderLock(training_args.output_dir).acquire()
        except ValueError as error:
            refusal = str(error)
        else:
            restored = run_folder.recover_replacements(Path(training_args.output_dir))
            if restored:
                print(f"kimi-k3-train: restored {', '.join(restored)} left mid-replacement by a killed job")
    refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        raise UsageError(refusal)
    return lock


def build_tokenizer(model_args: ModelArguments, train_split, checkpoint: str | None):
    """The resumed checkpoint's tokenizer, else the one given, else the fine-tuned model's, else a new BPE."""
    source = checkpoint or model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if source is not None:
        return load_tokenizer(source)
    return train_bpe_tokenizer(tokenizer_documents(train_split), model_args.tokenizer_vocab_size)


def build_model(model_args: ModelArguments, tokenizer, checkpoint: str | None,
                qk_clip_tau: float | None) -> KimiK3ForCausalLM:
    """A new model sized by the tokenizer, the fine-tuned folder, or the resumed checkpoint's architecture.

    A resumed model gets its weights from Trainer's checkpoint loading, together with the optimizer state.
    """
    config, source = model_config(model_args, tokenizer, checkpoint)
    check_model_fits_memory(config, source)
    if checkpoint is None and model_args.model_name_or_path is not None:
        model = causal_lm_class(config).from_pretrained(model_args.model_name_or_path, config=config)
        refuse_non_finite_base_model(model, model_args.model_name_or_path)
    else:
        model = causal_lm_class(config)(config)
    check_tokenizer_fits(tokenizer, model.config)
    use_fused_kernels(model, situ=model_args.fused_situ, attention_residuals=model_args.fused_attention_residuals,
                      experts=model_args.sorted_experts)
    if qk_clip_tau is not None and not model.config.mla_layer_indices:
        raise UsageError(
            f"--qk_clip_tau {model_args.qk_clip_tau}: QK-Clip rescales MLA heads but the model has no MLA "
            "(full_attention) layer; pass --qk_clip_tau none"
        )
    return model


def model_config(model_args: ModelArguments, tokenizer, checkpoint: str | None) -> tuple[KimiK3Config, str]:
    """The model's config with --config_overrides applied, and the flag it came from."""
    overrides = config_overrides(model_args.config_overrides)
    for flag, folder in (("--resume_from_checkpoint", checkpoint), ("--model_name_or_path", model_args.model_name_or_path)):
        if folder is not None:
            return read_config(folder, flag, overrides), f"{flag} {folder}"
    token_ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    return KimiK3Config(**{**token_ids, **overrides}), "--config_overrides"


def read_config(folder: str, flag: str, overrides: dict) -> KimiK3Config:
    """transformers reports an unreadable or missing config.json as an ``OSError``; say it in one line."""
    try:
        return KimiK3Config.from_pretrained(folder, **overrides)
    except OSError as error:
        raise UsageError(f"{flag} {folder}: {first_line(error)}") from None


def refuse_non_finite_base_model(model: KimiK3ForCausalLM, name_or_path: str) -> None:
    found = first_non_finite(model.named_parameters())
    if found is not None:
        raise UsageError(
            f"--model_name_or_path {name_or_path}: its tensor {found[0]} holds {found[1]} non-finite value(s) (NaN or "
            "infinity); fine-tune from a folder saved before that model diverged"
        )


def attach_expert_qat(model_args: ModelArguments, model: KimiK3ForCausalLM) -> None:
    """Fake-quantize the routed experts in every forward when --qat is given (`attach_qat`); checked before training,
    as is a released final layout, which needs MXFP4-groupable expert widths."""
    if model_args.final_layout == "released":
        check_exportable(model.config, "--final_layout released")
        check_mxfp4_widths(find_routed_experts(model), "--final_layout released")
    if model_args.qat is None:
        if model_args.qat_activations != "none":
            raise UsageError(f"--qat_activations {model_args.qat_activations} needs --qat {WEIGHT_FORMATS[0]}")
        return
    attach_qat(model, model_args.qat, model_args.qat_activations)


def optimizer_and_callbacks(model_args: ModelArguments, training_args: TrainingArguments, model,
                            qk_clip_tau: float | None):
    """(Per-Head) Muon through Trainer's optimizer-factory hook (or Trainer's own AdamW); QK-Clip and the router
    balancing, which the callbacks attach to that optimizer's step hooks and whose statistics join the logs; the
    auxiliary balance loss, when asked for; and the recorder of expert loads for the card's picture."""
    optimizer_cls_and_kwargs = None
    if model_args.optimizer != "adamw":
        optimizer_cls_and_kwargs = PerHeadMuonFactory.from_training_args(
            training_args, ns_dtype=model_args.muon_ns_dtype, per_head=model_args.optimizer == "per_head_muon"
        )
    callbacks = []
    if qk_clip_tau is not None:
        callbacks.append(QKClipCallback(qk_clip_tau))
    if find_routers(model):
        balancing = QuantileBalancingCallback(model, update_rule=model_args.router_balancing,
                                              sign_gamma=model_args.sign_balancing_gamma, per_layer_metrics=False)
        callbacks += [balancing, ExpertLoadRecorder(balancing.policy)]
        if model_args.aux_loss_alpha:
            # Trainer sums the micro-batches' losses of a step (their token losses share one normaliser), so each
            # micro-batch carries 1/N of the step's auxiliary term.
            alpha = model_args.aux_loss_alpha / training_args.gradient_accumulation_steps
            callbacks.append(AuxiliaryBalanceLossCallback(model, alpha))
        if model_args.expert_merging_every_n_steps:
            callbacks.append(ExpertMergingCallback(
                balancing.policy, model_args.expert_merging_every_n_steps, model_args.expert_merging_threshold,
                model_args.expert_merging_max_per_layer, seed=training_args.seed,
            ))  # fmt: skip
    elif model_args.expert_merging_every_n_steps:
        raise UsageError("--expert_merging_every_n_steps merges routed experts, and the model has none (num_experts)")
    elif model_args.aux_loss_alpha:
        raise UsageError("--aux_loss_alpha balances MoE routers, and the model has none (num_experts)")
    return optimizer_cls_and_kwargs, callbacks


def build_trainer(model, tokenizer, blocks, training_args, optimizer_cls_and_kwargs, callbacks,
                  settings: dict | None = None) -> KimiK3Trainer:
    """The job's Trainer; ``settings`` (`run_settings`) go into every checkpoint, for a resume to compare."""
    train_blocks = blocks["train"]
    if isinstance(train_blocks, datasets.IterableDataset):
        # Endless, so Trainer never starts a second epoch of an unsized stream: a resume then skips its trained batches
        # within one deterministic pass and lands where the interrupted run was, however often the stream wrapped.
        train_blocks = train_blocks.repeat(None)
    trainer = KimiK3Trainer(
        model=model,
        args=training_args,
        train_dataset=train_blocks,
        eval_dataset=blocks["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        callbacks=callbacks,
    )
    trainer.run_settings = settings
    return trainer


if __name__ == "__main__":
    sys.exit(main())
