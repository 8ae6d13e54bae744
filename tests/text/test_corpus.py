"""Where the training text comes from: a dataset by name (cached by an earlier download and read offline, a local
folder, a ``save_to_disk`` folder), data files whose builder follows their suffix under a compression suffix, glob
patterns, and a stream packed on the fly whose evaluation is bounded and whose resume is bit-exact."""

import csv
import gzip
import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from datasets.packaged_modules.json.json import Json, JsonConfig
from huggingface_hub import ModelCard
from transformers import TrainingArguments

from kimi_k3.job import arguments
from kimi_k3.job import main as train
from kimi_k3.job.trainer import KimiK3Trainer
from kimi_k3.text import corpus as data
from kimi_k3.text.tokenizer import load_tokenizer, train_bpe_tokenizer
from tests.job.test_train import run_interrupted, run_main, tiny_args, weights
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config

# Single-paragraph documents, so every builder (text reads paragraphs) sees the same ones.
DOCUMENTS = [" ".join(topic.split())[:240] for topic in data.reference_topics()[:40]]


def all_documents(splits) -> list[str]:
    return [row["text"] for name in ("train", "validation") for row in splits[name]]


def cache_as_downloaded(cache: Path, repo_id: str, splits: dict[str, list[dict]], workdir: Path) -> None:
    """Leave in ``cache`` what ``load_dataset(repo_id)`` leaves after downloading a hub repository of JSON-lines
    files: ``<namespace>___<name>/default/0.0.0/<commit>/<name>-<split>.arrow`` and its ``dataset_info.json``.

    A hub repository's files become the builder's predefined "default" configuration, so the folder is named after
    the configuration alone; the builder runs on local copies and its folder then gets the repository's namespace.
    """
    namespace, name = repo_id.split("/")
    files = {}
    for split, rows in splits.items():
        files[split] = [str(workdir / f"{split}.jsonl")]
        Path(files[split][0]).write_text("".join(json.dumps(row) + "\n" for row in rows))

    default = JsonConfig(name="default", data_files=datasets.data_files.DataFilesDict.from_patterns(files))
    # Declared in the JSON builder's module: `datasets` patches the globals (open, gzip.open, ...) of every module in
    # a builder's class hierarchy for streaming, and this test module's must stay the standard library's.
    repository = type("HubRepository", (Json,), {"BUILDER_CONFIGS": [default], "__module__": Json.__module__})
    repository(cache_dir=str(cache), dataset_name=name, config_name="default", hash="0" * 40).download_and_prepare()
    shutil.move(cache / name, cache / f"{namespace}___{name}")


# ---------------------------------------------------------------------------------------------------------------------
# --dataset_name
# ---------------------------------------------------------------------------------------------------------------------
def test_dataset_cached_by_an_earlier_download_loads_by_name_offline(tmp_path, monkeypatch):
    assert datasets.config.HF_HUB_OFFLINE  # nothing can be downloaded: only the cache can serve the name
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    rows = [{"content": text, "id": index} for index, text in enumerate(DOCUMENTS)]
    cache_as_downloaded(tmp_path / "cache", "someone/tiny_corpus", {"train": rows[:36], "validation": rows[36:]}, tmp_path)

    for streaming in (False, True):
        splits, description = data.load_corpus(
            None, "content", 5.0, dataset_name="someone/tiny_corpus", streaming=streaming
        )
        assert [row["text"] for row in splits["train"]] == DOCUMENTS[:36]
        assert [row["text"] for row in splits["validation"]] == DOCUMENTS[36:]  # its own split, not a hold-out
        assert description == "dataset someone/tiny_corpus" + (", streamed" if streaming else "")

    args = ["--dataset_name", "someone/tiny_corpus", "--text_column", "content", "--max_steps", "2", "--save_steps", "2"]
    assert run_main(tiny_args(tmp_path / "run", None, *args))[0] == 0
    card = ModelCard.load(tmp_path / "run" / "model" / "README.md")
    assert "| data | dataset someone/tiny_corpus |" in card.text and card.data.datasets == ["someone/tiny_corpus"]
    assert card.data.language is None  # not the embedded (English) corpus


def test_local_dataset_folders_hold_out_the_validation_percentage_when_they_have_no_validation_split(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))

    in_memory, _ = data.load_corpus(None, "text", 10.0, dataset_name=str(folder))
    assert len(in_memory["validation"]) == 4 and sorted(all_documents(in_memory)) == sorted(DOCUMENTS)
    assert not set(in_memory["train"]["text"]) & set(in_memory["validation"]["text"])
    # A stream holds out evenly spaced documents, in order: every 10th for 10 %.
    streamed, _ = data.load_corpus(None, "text", 10.0, dataset_name=str(folder), streaming=True)
    assert [row["text"] for row in streamed["validation"]] == DOCUMENTS[9::10]
    assert [row["text"] for row in streamed["train"]] == [t for i, t in enumerate(DOCUMENTS) if i % 10 != 9]

    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": DOCUMENTS[:30]}),
        "validation": datasets.Dataset.from_dict({"text": DOCUMENTS[30:]}),
    }).save_to_disk(saved)  # fmt: skip
    for streaming in (False, True):
        splits, _ = data.load_corpus(None, "text", 10.0, dataset_name=str(saved), streaming=streaming)
        assert all_documents(splits) == DOCUMENTS


# ---------------------------------------------------------------------------------------------------------------------
# --data_files
# ---------------------------------------------------------------------------------------------------------------------
def test_data_files_choose_the_builder_from_the_suffix_under_a_compression_suffix(tmp_path):
    with open(tmp_path / "corpus.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "body"])
        writer.writerows(enumerate(DOCUMENTS))
    with gzip.open(tmp_path / "corpus.JSONL.gz", "wt") as handle:
        handle.writelines(json.dumps({"body": text}) + "\n" for text in DOCUMENTS)
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "a.txt").write_text("\n\n".join(DOCUMENTS[:20]))
    (tmp_path / "parts" / "b.txt").write_text("\n\n".join(DOCUMENTS[20:]))
    (tmp_path / "parts" / "notes.rst").write_text("not matched by the pattern")

    assert data.data_format(str(tmp_path / "corpus.JSONL.gz")) == ".jsonl"
    cases = {"corpus.csv": "body", "corpus.JSONL.gz": "body", "parts/*.txt": "text"}
    for pattern, column in cases.items():
        for streaming in (False, True):
            splits, description = data.load_corpus([str(tmp_path / pattern)], column, 10.0, streaming=streaming)
            assert sorted(all_documents(splits)) == sorted(DOCUMENTS), (pattern, streaming)
    assert description == "local files: a.txt, b.txt, streamed"  # names only: the description is published


# ---------------------------------------------------------------------------------------------------------------------
# --packing
# ---------------------------------------------------------------------------------------------------------------------
def test_the_jobs_trainer_hands_document_blocks_to_the_model_with_their_position_ids(tmp_path):
    """Trainer drops the columns the model's forward does not name: the restarting position ids must reach it."""
    tokenizer = train_bpe_tokenizer(DOCUMENTS, vocab_size=300)
    splits = data.train_validation_split(datasets.Dataset.from_dict({"text": DOCUMENTS}), 10)
    blocks = data.tokenize_into_blocks(splits, tokenizer, 16)
    model = KimiK3ForCausalLM(tiny_config(vocab_size=300))
    arguments = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                  per_device_train_batch_size=4)
    trainer = train.build_trainer(model, tokenizer, blocks, arguments, None, [])
    batches = list(trainer.get_train_dataloader())
    assert all(batch.keys() == {"input_ids", "position_ids", "labels"} for batch in batches)
    positions = torch.cat([batch["position_ids"] for batch in batches])
    assert (positions[:, 1:] != positions[:, :-1] + 1).any()  # documents start inside blocks
    assert torch.equal(torch.cat([batch["labels"] for batch in batches]) == -100, positions == 0)


# ---------------------------------------------------------------------------------------------------------------------
# --streaming
# ---------------------------------------------------------------------------------------------------------------------
def test_stream_packs_the_blocks_of_the_in_memory_split():
    tokenizer = train_bpe_tokenizer(DOCUMENTS, vocab_size=300)
    in_memory = datasets.Dataset.from_dict({"text": DOCUMENTS})
    blocks = data.tokenize_into_blocks(datasets.DatasetDict({"train": in_memory}), tokenizer, 16)["train"]
    streamed = data.tokenize_into_blocks(
        datasets.IterableDatasetDict({"train": in_memory.to_iterable_dataset()}), tokenizer, 16
    )["train"]
    assert isinstance(streamed, datasets.IterableDataset)
    # Fewer than STREAM_PACK_DOCUMENTS documents: one batch, packed exactly as in memory.
    assert list(streamed) == list(blocks) and len(blocks) > 20
    assert data.evaluation_blocks(streamed, 3)["input_ids"] == blocks["input_ids"][:3]


def test_streamed_run_wraps_evaluates_bounded_blocks_and_resumes_bit_exactly(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(text[:80] for text in DOCUMENTS[:8]))
    args = ["--streaming", "True", "--max_steps", "5", "--save_steps", "3", "--eval_steps", "3",
            "--max_eval_samples", "2", "--validation_split_percentage", "25"]  # fmt: skip
    assert run_main(tiny_args(tmp_path / "uninterrupted", corpus, *args))[0] == 0

    run_interrupted(tiny_args(tmp_path / "run", corpus, *args), global_step=4)
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["checkpoint-3"]
    assert run_main(tiny_args(tmp_path / "run", corpus, *args, "--resume_from_checkpoint", "True"))[0] == 0

    expected, resumed = weights(tmp_path / "uninterrupted" / "model"), weights(tmp_path / "run" / "model")
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[key], resumed[key]) for key in expected)
    # A pass over the train stream holds 7 blocks, so the 3 x 4 blocks before the checkpoint end inside the second
    # pass: the resume skipped across the stream's restart (where Trainer, left to count epochs, would restart it).
    splits, _ = data.load_corpus([str(corpus)], "text", 25.0, streaming=True)
    blocks = data.tokenize_into_blocks(splits, load_tokenizer(tmp_path / "run" / "model"), 32)
    assert len(list(blocks["train"])) == 7
    state = json.loads((tmp_path / "run" / "checkpoint-5" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "eval_loss" in entry] == [3, 5]
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    # 5 steps x 4 blocks trained on; 2 evaluation blocks.
    assert "| tokens (train / eval) | 640 / 64 in blocks of 32 |" in card and ", streamed |" in card


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the flag and what it accepts
# ---------------------------------------------------------------------------------------------------------------------
def write(folder: Path, name: str, text: str) -> str:
    (folder / name).write_text(text)
    return str(folder / name)


BAD_SOURCES = {
    "dataset name and data files": (
        lambda tmp: ["--dataset_name", "someone/corpus", "--data_files", write(tmp, "a.txt", "a b")],
        "--dataset_name and --data_files are two sources of training text; give one: --dataset_name NAME "
        "[--dataset_config_name CONFIG], or --data_files FILE ...",
    ),
    "configuration without a dataset": (
        lambda tmp: ["--dataset_config_name", "raw"], "--dataset_config_name raw needs --dataset_name"
    ),
    "dataset neither cached nor reachable": (
        lambda tmp: ["--dataset_name", "someone/not-cached"],
        "--dataset_name someone/not-cached: cannot load the dataset: Couldn't reach 'someone/not-cached' on the Hub",
    ),
    "unknown suffix": (
        lambda tmp: ["--data_files", write(tmp, "notes.rst", "a b")],
        "--data_files must all have one of the suffixes .txt, .text, .json, .jsonl, .csv, .parquet (one format per "
        "run), optionally compressed (.gz, .bz2, .xz); got .rst in ",
    ),
    "glob matching nothing": (
        lambda tmp: ["--data_files", str(tmp / "data" / "*.txt")], "/data/*.txt matches no file"
    ),
    "missing text column": (
        lambda tmp: ["--data_files", write(tmp, "a.csv", "id,body\n1,a b c\n2,d e f\n")],
        "--text_column 'text' is not a column of --data_files",
    ),
    "folder of data files as --data_files": (
        lambda tmp: ["--data_files", str(tmp)], "is a folder but not one written by `save_to_disk`"
    ),
    "streaming without max_steps": (
        lambda tmp: ["--streaming", "True", "--max_steps", "-1"],
        "--streaming needs --max_steps > 0 (a stream has no length to count epochs in), got -1",
    ),
    "no evaluation blocks": (
        lambda tmp: ["--max_eval_samples", "0"], "--max_eval_samples must be >= 1 (or left out for all blocks), got 0"
    ),
    "streamed JSON text field holding a number": (
        lambda tmp: ["--streaming", "True", "--data_files", write(tmp, "mixed.jsonl", '{"text": "a b"}\n{"text": 5}\n')],
        "column 'text' must hold text, but row 1 holds int 5",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_bad_data_source_stops_with_one_line_naming_the_flag(case, tmp_path, capsys):
    extra, message = BAD_SOURCES[case]
    assert train.main(tiny_args(tmp_path / "out", None, *extra(tmp_path))) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kimi-k3-train: error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_bad_row_met_in_the_middle_of_a_stream_stops_the_job_with_one_line(tmp_path, capsys, monkeypatch):
    rows = [{"text": text} for text in DOCUMENTS[:4]] + [{"text": 5}] + [{"text": text} for text in DOCUMENTS[4:]]
    corpus = write(tmp_path, "corpus.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    train_bpe_tokenizer(DOCUMENTS, vocab_size=300).save_pretrained(tmp_path / "tokenizer")
    monkeypatch.setattr(data, "STREAM_PACK_DOCUMENTS", 1)  # the start-up reads stop at the first document
    args = ["--streaming", "True", "--tokenizer_name_or_path", str(tmp_path / "tokenizer"), "--max_eval_samples", "1",
            "--validation_split_percentage", "50"]  # fmt: skip
    steps, training_step = [], KimiK3Trainer.training_step
    monkeypatch.setattr(KimiK3Trainer, "training_step", lambda *a, **k: steps.append(1) or training_step(*a, **k))
    status, _ = run_main(tiny_args(tmp_path / "out", corpus, *args))
    assert status == 2 and len(steps) == 1  # the first step trained on documents 0 and 2; the second met row 4
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kimi-k3-train: error:")]
    assert errors == [f"kimi-k3-train: error: --data_files {corpus}: column 'text' must hold text, but row 4 holds int 5"]
    assert not (tmp_path / "out").exists()


def test_missing_text_column_error_names_the_columns(tmp_path, capsys):
    args = tiny_args(tmp_path / "out", None, "--data_files", write(tmp_path, "a.csv", "id,body\n1,a b\n"))
    assert train.main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("; columns are ['body', 'id']")


def test_help_states_what_streaming_needs_and_how_evaluation_ends(capsys):
    with pytest.raises(SystemExit):
        arguments.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "needs --max_steps" in help_text
    assert f"with --streaming the first {data.STREAM_EVAL_BLOCKS}, read once at the start, so that evaluation ends" in help_text
    assert "--dataset_name" in help_text and "--dataset_config_name" in help_text


def test_a_data_file_whose_name_holds_glob_characters_names_itself(tmp_path):
    notes = tmp_path / "notes [v2].txt"
    notes.write_text("first document\n\nsecond document\n")
    assert data.expand_data_files([str(notes)]) == [str(notes)]
