"""Packed documents: a row of several documents (restarting ``position_ids``, ``cu_seq_lens_q/k``, ``seq_idx``) computes
what the documents compute one by one, in every mixer, with and without a cache; bad packing input is refused in one
line; statistics recorded from outside count what attention uses."""

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, DynamicCache

from kimi_k3.policies.qk_clip import QKClip
from kimi_k3.attachments.seams import find_routers
from kimi_k3.policies.quantile_balancing import QuantileBalancing
from kimi_k3.text.tokenizer import train_bpe_tokenizer
from kda_kimi_k3 import chunk_kda
from modeling_kimi_k3 import CACHE_FIELD, KimiK3ForCausalLM, KimiK3ShortConvolution, upcast
from packing_kimi_k3 import positions_in_documents
from tests.conftest import TINY_CONFIG, seeded_generator, tiny_config
from tests.numerics import assert_as_accurate, perturb_parameters
from tests.test_fast_paths import HostSyncRecorder
from tests.test_kda import packed_lengths, starts_of
from tests.test_modeling import build as build_model

pytestmark = pytest.mark.device  # runs on KIMI_K3_TEST_DEVICE (tests/conftest.py)

LAYERS = TINY_CONFIG["num_hidden_layers"]
# Which mixers the model is built of (None: the tiny model's hybrid pattern), and the attention implementation of its
# MLA layers.
MIXERS = {
    "kda": (["linear_attention"] * LAYERS, "sdpa"),
    "mla-sdpa": (["full_attention"] * LAYERS, "sdpa"),
    "mla-eager": (["full_attention"] * LAYERS, "eager"),
    "hybrid": (None, "sdpa"),
}
KDA_CHUNK = inspect.signature(chunk_kda).parameters["chunk_size"].default  # the chunk size of the model's KDA layers


def build(mixers: str) -> KimiK3ForCausalLM:
    """An fp32 model of ``mixers`` in training mode, with non-trivial AttnRes pseudo-queries and router biases."""
    layer_types, implementation = MIXERS[mixers]
    # A model of KDA layers alone has no attention layer for transformers' cache to count tokens in.
    config = tiny_config(layer_types=layer_types, use_cache=mixers != "kda")
    config._attn_implementation = implementation
    return build_model(config, dtype=torch.float32).train()


def in_float64(model: KimiK3ForCausalLM, perturbation_seed: int | None = None) -> KimiK3ForCausalLM:
    exact = copy.deepcopy(model).double()
    exact.set_experts_implementation("eager")  # grouped_mm kernels have no fp64 path
    return exact if perturbation_seed is None else perturb_parameters(exact, perturbation_seed)


def documents_of(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = seeded_generator(seed)
    return [torch.randint(3, TINY_CONFIG["vocab_size"], (n,), generator=gen) for n in lengths]


def packed_row(documents: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One row in DataCollatorWithFlattening's layout: position ids restarting at 0, first labels ignored."""
    position_ids = torch.cat([torch.arange(len(document)) for document in documents])
    labels = torch.cat(documents).masked_fill(position_ids == 0, -100)
    return {"input_ids": torch.cat(documents), "position_ids": position_ids, "labels": labels}


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run_packed(model, rows: list[list[torch.Tensor]], use_cache: bool) -> dict:
    """Rows of packed documents (of equal total length) in one forward and backward."""
    model.zero_grad()
    batch = {key: torch.stack([packed_row(row)[key] for row in rows]) for key in ("input_ids", "position_ids", "labels")}
    output = model(**batch, use_cache=use_cache)
    output.loss.backward()
    return {"logits": output.logits.detach(), "loss": output.loss.detach(), "grads": gradients(model)}


def run_one_by_one(model, rows: list[list[torch.Tensor]], use_cache: bool) -> dict:
    """Each document alone, arranged as in ``rows``; the loss is what the packed rows' loss means: the summed
    next-token cross-entropy of every document over the count of predicted tokens."""
    model.zero_grad()
    logits = {}
    for document in {id(document): document for row in rows for document in row}.values():
        logits[id(document)] = model(document[None], use_cache=use_cache).logits[0]
    total = sum(F.cross_entropy(upcast(logits[id(document)][:-1]), document[1:], reduction="sum")
                for row in rows for document in row)
    loss = total / sum(len(document) - 1 for row in rows for document in row)
    loss.backward()
    joined = torch.stack([torch.cat([logits[id(document)] for document in row]) for row in rows])
    return {"logits": joined.detach(), "loss": loss.detach(), "grads": gradients(model)}


# A model of KDA layers only cannot hold a cache (transformers' hybrid cache sizes itself by its attention layers):
# KDA with a cache is covered by the hybrid model and by the layer test below.
@pytest.mark.parametrize(
    "mixers, use_cache",
    [("kda", False), ("mla-sdpa", False), ("mla-sdpa", True), ("mla-eager", False), ("mla-eager", True),
     ("hybrid", False), ("hybrid", True)],
)
def test_packed_rows_give_the_logits_loss_and_gradients_of_the_documents_run_one_by_one(mixers, use_cache):
    """Random lengths, among them a single token, a document ending exactly on a KDA chunk boundary and one filling
    a chunk; two rows holding the documents in opposite orders. Within fp32 rounding of float64 runs of the documents
    one by one (the spread of a run under fp32-sized parameter perturbations measures that rounding: the KDA decay
    gradients sum many terms with cancellation)."""
    documents = documents_of(packed_lengths(KDA_CHUNK, seed=1, longest_random=12))
    rows = [documents, documents[::-1]]
    model = build(mixers)
    packed, trusted = run_packed(model, rows, use_cache), run_one_by_one(model, rows, use_cache)
    exact = run_one_by_one(in_float64(model), rows, use_cache)
    perturbed = [run_one_by_one(in_float64(model, perturbation_seed=1), rows, use_cache)]
    for key in ("logits", "loss"):
        assert_as_accurate(packed[key], trusted[key], exact[key], [run[key] for run in perturbed], key)
    assert packed["grads"].keys() == trusted["grads"].keys() == exact["grads"].keys()
    for name, grad in packed["grads"].items():
        assert_as_accurate(grad, trusted["grads"][name], exact["grads"][name],
                           [run["grads"][name] for run in perturbed], name)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_recomputes_packed_rows_exactly(use_reentrant):
    """The document starts reach the recomputed layers: loss and gradients are bitwise those without checkpointing."""
    rows = [documents_of([5, 1, 30, 7])]
    model = build("hybrid")
    plain = run_packed(model, rows, use_cache=False)
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    checkpointed = run_packed(model, rows, use_cache=False)
    assert torch.equal(checkpointed["loss"], plain["loss"]) and checkpointed["grads"].keys() == plain["grads"].keys()
    assert all(torch.equal(grad, plain["grads"][name]) for name, grad in checkpointed["grads"].items())


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_kda_layer_gives_the_outputs_and_gradients_of_its_documents_run_one_by_one(use_cache):
    """The layer alone, with a fresh hybrid cache per forward or none: outputs, and the gradients of its input and
    parameters for a random cotangent, within fp32 rounding of float64."""
    config = tiny_config()
    lengths = packed_lengths(KDA_CHUNK, seed=2, longest_random=12)
    layer = build("hybrid").model.layers[0].self_attn
    hidden = torch.randn(1, sum(lengths), config.hidden_size, dtype=torch.float64)
    cotangent = torch.randn_like(hidden)

    def run(layer, packed: bool) -> list[torch.Tensor]:
        inputs = hidden.to(layer.o_proj.weight.dtype).requires_grad_()
        pieces = [inputs] if packed else inputs.split(lengths, dim=1)
        starts = starts_of(lengths) if packed else None
        cache = (lambda: DynamicCache(config=config)) if use_cache else (lambda: None)
        output = torch.cat([layer(piece, cache=cache(), document_starts=starts)[0] for piece in pieces], dim=1)
        return [output, *torch.autograd.grad((output * cotangent.to(output.dtype)).sum(), [inputs, *layer.parameters()])]

    packed, trusted = run(layer, packed=True), run(layer, packed=False)
    exact = run(copy.deepcopy(layer).double(), packed=False)
    perturbed = run(perturb_parameters(copy.deepcopy(layer).double(), seed=1), packed=False)
    names = ["output", "input gradient", *(name for name, _ in layer.named_parameters())]
    for name, *values in zip(names, packed, trusted, exact, perturbed):
        assert_as_accurate(*values[:3], [values[3]], name)


def test_short_convolution_reads_no_token_of_another_document_fp64():
    lengths = [5, 1, 2, 9, 3]
    conv = KimiK3ShortConvolution(6, kernel_size=4).double()
    x = torch.randn(1, 6, sum(lengths), dtype=torch.float64)
    packed = conv(x, positions_in_documents(starts_of(lengths)))
    alone = torch.cat([conv(piece) for piece in x.split(lengths, dim=-1)], dim=-1)
    assert (packed - alone).abs().max() <= 1e-14
    one_document = conv(x, positions_in_documents(torch.zeros(1, sum(lengths), dtype=torch.bool)))
    assert (one_document - conv(x)).abs().max() <= 1e-14  # the tap sums equal conv1d's


def test_positions_in_documents_count_from_every_start_and_from_the_row_start():
    starts = torch.tensor([[False, False, True, True, False, False, True], [False, True, False, False, False, True, False]])
    assert positions_in_documents(starts).tolist() == [[0, 1, 0, 0, 1, 2, 0], [0, 0, 1, 2, 3, 0, 1]]


# ---------------------------------------------------------------------------------------------------------------------
# The packing conventions
# ---------------------------------------------------------------------------------------------------------------------
def collated(documents: list[torch.Tensor], **options) -> dict:
    features = [{"input_ids": document.tolist()} for document in documents]
    return DataCollatorWithFlattening(return_tensors="pt", **options)(features)


def test_every_packing_convention_marks_the_same_documents():
    """position_ids alone, cu_seq_lens_q/k alone, seq_idx alone and DataCollatorWithFlattening's full output."""
    documents = documents_of([4, 1, 7, 3])
    model = build("hybrid").eval()
    batch = collated(documents, return_flash_attn_kwargs=True, return_seq_idx=True)
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"} <= batch.keys()
    with torch.no_grad():
        logits = {name: model(batch["input_ids"], **{name: batch[name]}).logits
                  for name in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")}
        logits["all"] = model(**{key: value for key, value in batch.items() if key != "labels"}).logits
        logits["unpacked"] = model(batch["input_ids"]).logits
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "all"):
        assert torch.equal(logits[name], logits["position_ids"]), name
    assert (logits["unpacked"] - logits["position_ids"]).abs().max() > 1e-2  # the later documents would leak


def test_data_collator_with_flattening_batch_trains_every_document_as_if_alone():
    documents = documents_of(packed_lengths(KDA_CHUNK, seed=3, longest_random=12), seed=3)
    model = build("hybrid")
    batch = collated(documents, return_flash_attn_kwargs=True)
    output = model(**batch)
    output.loss.backward()
    packed = {"logits": output.logits.detach(), "loss": output.loss.detach(), "grads": gradients(model)}
    trusted = run_one_by_one(model, [documents], use_cache=False)
    exact = run_one_by_one(in_float64(model), [documents], use_cache=False)
    perturbed = run_one_by_one(in_float64(model, perturbation_seed=1), [documents], use_cache=False)
    for key in ("logits", "loss"):
        assert_as_accurate(packed[key], trusted[key], exact[key], [perturbed[key]], key)
    for name, grad in packed["grads"].items():
        assert_as_accurate(grad, trusted["grads"][name], exact["grads"][name], [perturbed["grads"][name]], name)


def test_position_ids_beside_a_padding_mask_are_positions_not_documents():
    """Left padding makes generation-style position ids restart; with the 2-D mask given they mark no document."""
    model = build("hybrid").eval()
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask, position_ids=position_ids).logits,
                           model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize(
    "packing, message",
    [
        ({"cu_seq_lens_q": torch.tensor([0, 3, 9])}, r"`cu_seq_lens_q` must rise from 0 to batch x seq_len = 10 "),
        ({"cu_seq_lens_k": torch.tensor([0, 6, 4, 10])}, r"`cu_seq_lens_k` must rise from 0 .* got \[0, 6, 4, 10\]"),
        ({"cu_seq_lens_q": torch.tensor([[0, 10]])}, r"`cu_seq_lens_q` must be a 1-D integer tensor"),
        ({"seq_idx": torch.zeros(1, 9, dtype=torch.long)}, r"`seq_idx` must have shape \[batch=1, seq_len=10\]"),
        ({"position_ids": torch.arange(10)}, r"`position_ids` must have shape \[batch=1, seq_len=10\]"),
    ],
)
def test_malformed_packing_input_is_refused_in_one_line_naming_the_field(packing, message):
    model = build("hybrid").eval()
    with pytest.raises(ValueError, match=message):
        model(torch.randint(3, 97, (1, 10)), **packing)


@pytest.mark.parametrize(
    "packing, marker",
    [
        ({"position_ids": torch.tensor([[6, 0, 1]])}, "restarting `position_ids`"),
        ({"seq_idx": torch.tensor([[0, 0, 0]])}, "`seq_idx`"),
        ({"cu_seq_lens_q": torch.tensor([0, 3])}, "`cu_seq_lens_q`"),
    ],
)
def test_packed_documents_cannot_continue_a_cache(packing, marker):
    model = build("hybrid").eval()
    with torch.no_grad():
        cache = getattr(model(torch.randint(3, 97, (1, 6)), use_cache=True), CACHE_FIELD)
        with pytest.raises(ValueError, match=f"Packed documents \\({marker}\\) cannot continue a cache"):
            model(torch.randint(3, 97, (1, 3)), cache=cache, **packing)
        continuing = model(torch.randint(3, 97, (1, 3)), cache=cache, position_ids=torch.tensor([[6, 7, 8]]))
    assert continuing.logits.shape == (1, 3, 97)


@pytest.mark.parametrize("collator_options", [{}, {"return_flash_attn_kwargs": True}, {"return_seq_idx": True}])
def test_generate_refuses_a_packed_batch_in_one_line(collator_options):
    model = build("hybrid").eval()
    batch = collated(documents_of([4, 3]), **collator_options)
    batch.pop("labels")
    with pytest.raises(ValueError, match=r"^generate\(\) got packed documents \(.+\); give each prompt its own row"):
        model.generate(**batch, max_new_tokens=2)
    unpacked = model.generate(batch["input_ids"], position_ids=torch.arange(7)[None], max_new_tokens=2)
    assert unpacked.shape == (1, 9)


# ---------------------------------------------------------------------------------------------------------------------
# What attaches from outside
# ---------------------------------------------------------------------------------------------------------------------
def test_quantile_balancing_and_qk_clip_record_a_packed_row_as_its_documents_one_by_one():
    """Every real token is routed and counted once; QK-Clip sees only the logits attention uses (one document's)."""
    documents = documents_of([5, 1, 12, 7])
    model = in_float64(build("hybrid"))  # in fp32, a near tie could route one token two ways in the two runs
    for router in find_routers(model).values():
        router.e_score_correction_bias = router.e_score_correction_bias.float()
    balancing, clip = QuantileBalancing(model), QKClip(model, tau=100.0)
    balancing.attach(), clip.attach()

    def recorded(rows):
        for stats in balancing.statistics.values():
            stats.reset()
        for _, recorder in clip.recorders.values():
            recorder.maximum.fill_(-torch.inf)
        for row in rows:
            model(**{key: value[None] for key, value in packed_row(row).items()})
        counts = torch.stack([stats.tokens_per_expert for stats in balancing.statistics.values()])
        histograms = torch.stack([stats.histogram for stats in balancing.statistics.values()])
        return counts, histograms, torch.stack([recorder.maximum for _, recorder in clip.recorders.values()])

    packed, alone = recorded([documents]), recorded([[document] for document in documents])
    assert packed[0].sum() == sum(len(d) for d in documents) * model.config.num_experts_per_token * len(packed[0])
    assert torch.equal(packed[0], alone[0]) and torch.equal(packed[1], alone[1])
    assert (packed[2] - alone[2]).abs().max() <= 1e-12


def test_a_packed_training_step_never_waits_for_the_device_in_model_code():
    """position_ids and seq_idx (cu_seq_lens are range-checked on CPU only, by design, as input ids are)."""
    model = build("hybrid")
    QuantileBalancing(model).attach(), QKClip(model, tau=100.0).attach()
    batch = collated(documents_of([6, 1, 9, 4]), return_seq_idx=True)
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach()
    with HostSyncRecorder() as recorder:
        model(inputs_embeds=embeds, **batch).loss.backward()
    assert recorder.syncs == []


# ---------------------------------------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------------------------------------
def test_trl_sft_trainer_packing_gives_every_sequence_its_unpacked_logits(tmp_path):
    """``SFTTrainer(packing=True)`` (best-fit packing, padding-free: restarting position ids, cu_seq_lens, no mask) on
    a saved folder loaded with ``trust_remote_code``: each packed sequence's logits are within fp32 rounding of a
    float64 run of that sequence alone."""
    trl = pytest.importorskip("trl", reason="TRL is not installed; the dev extra brings it (pip install -e '.[dev]')")
    texts = [" ".join(f"word{i * j % 23}" for j in range(1 + 3 * i % 17)) for i in range(12)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    KimiK3ForCausalLM(tiny_config(vocab_size=300)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", trust_remote_code=True)
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), packing=True, max_length=40, per_device_train_batch_size=4,
                         report_to="none", use_cpu=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                             processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch and {"position_ids", "cu_seq_lens_q"} <= batch.keys()
    lengths = batch["cu_seq_lens_q"].diff().tolist()
    assert len(lengths) > 2
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    model.eval()
    with torch.no_grad():
        packed = model(**inputs).logits[0].split(lengths)
        sequences = batch["input_ids"][0].split(lengths)
        alone = [model(sequence[None]).logits[0] for sequence in sequences]
        exact = [in_float64(model)(sequence[None]).logits[0] for sequence in sequences]
        leaking = model(batch["input_ids"]).logits[0].split(lengths)
    assert (leaking[1] - alone[1]).abs().max() > 1e-3  # what the packed batch would give read as one sequence
    for index, (actual, trusted, reference) in enumerate(zip(packed, alone, exact)):
        assert_as_accurate(actual, trusted, reference, what=f"sequence {index}")
