"""Training text: an embedded corpus that ships with Python, or local files, as ``datasets`` splits of token blocks.

The embedded corpus needs no download: the Python reference manual's topic pages (``pydoc_data.topics``) plus the
docstrings of a fixed list of standard-library modules. It is deterministic for a given Python version.
"""

import codecs
import importlib
import inspect
import platform
from pathlib import Path

import datasets

TEXT_COLUMN = "text"
# The train/validation split must not move when the training seed does: the tokenizer is trained on the train split.
SPLIT_SEED = 0
DOCSTRING_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools", "gzip",
    "hashlib", "heapq", "html", "http.client", "inspect", "io", "itertools", "json", "logging", "math", "operator",
    "pathlib", "pickle", "random", "re", "shutil", "statistics", "string", "struct", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "unittest", "urllib.parse", "uuid", "zipfile",
)
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """Unusable training data: missing files, an unknown format, or too little text."""


# ---------------------------------------------------------------------------------------------------------------------
# Raw documents
# ---------------------------------------------------------------------------------------------------------------------
def reference_topics() -> list[str]:
    """The pages of the Python language reference that ``help('topic')`` shows, sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)]


def stdlib_docstrings(module_names=DOCSTRING_MODULES) -> list[str]:
    """Module, class and function docstrings of ``module_names``, each headed by its qualified name."""
    documents = []
    for module_name in module_names:
        module = importlib.import_module(module_name)
        if module.__doc__:
            documents.append(f"{module_name}\n\n{inspect.cleandoc(module.__doc__)}")
        for name, obj in sorted(vars(module).items()):
            defined_here = getattr(obj, "__module__", None) == module_name
            if name.startswith("_") or not defined_here or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc:
                documents.append(f"{module_name}.{name}\n\n{doc}")
    return documents


def embedded_corpus() -> datasets.Dataset:
    """Reference topics followed by standard-library docstrings, one document per row."""
    return datasets.Dataset.from_dict({TEXT_COLUMN: reference_topics() + stdlib_docstrings()})


def embedded_corpus_description() -> str:
    return (
        f"Python {platform.python_version()} documentation shipped with the interpreter: the language reference "
        f"topics of `pydoc_data.topics` and the docstrings of {len(DOCSTRING_MODULES)} standard-library modules"
    )


def load_local_corpus(paths: list[str], text_column: str) -> datasets.Dataset | datasets.DatasetDict:
    """Text, JSON(-lines) or parquet files, or one folder written by ``Dataset(Dict).save_to_disk``.

    Only ``text_column`` is kept, renamed to ``"text"``; a text file gives one row per paragraph.
    """
    missing = [path for path in paths if not Path(path).exists()]
    if missing:
        raise DataError(f"--data_files: no such file or folder: {', '.join(missing)}")
    if len(paths) == 1 and Path(paths[0]).is_dir():
        loaded = datasets.load_from_disk(paths[0])
    else:
        builder = _file_builder(paths)
        for path in paths:
            check_readable_file(path, utf8_text=builder in ("text", "json"))
        # A text file's documents are its paragraphs: lines of one paragraph should not be cut apart by EOS tokens.
        options = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            loaded = datasets.load_dataset(builder, data_files=list(paths), split="train", **options)
        except datasets.exceptions.DatasetGenerationError as error:
            cause = error.__cause__ or error
            raise DataError(f"--data_files {', '.join(paths)}: {builder} files cannot be read: {cause}") from None
    column_names = loaded.column_names
    columns = next(iter(column_names.values())) if isinstance(column_names, dict) else column_names
    if text_column not in columns:
        raise DataError(f"--text_column {text_column!r} is not a column of {paths}; columns are {sorted(columns)}")
    loaded = loaded.select_columns([text_column])
    for split in loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]:
        check_text_values(split, text_column, paths)
    return loaded if text_column == TEXT_COLUMN else loaded.rename_column(text_column, TEXT_COLUMN)


def check_readable_file(path: str, utf8_text: bool, chunk_bytes: int = 1 << 20) -> None:
    """A data file must hold something; text and JSON files must be UTF-8 text (no NUL bytes)."""
    if Path(path).stat().st_size == 0:
        raise DataError(f"--data_files {path} is empty (0 bytes)")
    if not utf8_text:
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            if b"\0" in chunk:
                raise DataError(f"--data_files {path} is binary, not text (NUL byte at offset {offset + chunk.index(0)})")
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                raise DataError(
                    f"--data_files {path} is not UTF-8 text (byte 0x{chunk[error.start]:02x} at offset "
                    f"{offset + error.start}); convert it, e.g. with `iconv -t utf-8`"
                ) from None
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"--data_files {path} is not UTF-8 text (it ends inside a multi-byte character)") from None


def check_text_values(dataset: datasets.Dataset, column: str, paths: list[str]) -> None:
    """Every document must be a string (or null): JSON lines may mix numbers or objects into the text field."""
    if dataset.features[column] in (datasets.Value("string"), datasets.Value("large_string")):
        return
    for row, value in enumerate(dataset[column]):
        if value is not None and not isinstance(value, str):
            raise DataError(
                f"--data_files {', '.join(paths)}: column {column!r} must hold text, but row {row} holds "
                f"{type(value).__name__} {value!r:.40}"
            )


def load_corpus(
    data_files: list[str] | None, text_column: str, validation_percentage: float
) -> tuple[datasets.DatasetDict, str]:
    """Train/validation documents in column ``"text"`` and a one-line description of where they came from."""
    if data_files:
        corpus, description = load_local_corpus(data_files, text_column), f"local files: {', '.join(data_files)}"
    else:
        corpus, description = embedded_corpus(), embedded_corpus_description()
    return train_validation_split(corpus, validation_percentage), description


def _file_builder(paths: list[str]) -> str:
    suffixes = {Path(path).suffix.lower() for path in paths}
    builders = {FILE_BUILDERS.get(suffix) for suffix in suffixes}
    if None in builders or len(builders) != 1:
        raise DataError(
            f"--data_files must all have one of the suffixes {sorted(FILE_BUILDERS)} (one format per run), "
            f"got {sorted(suffixes)}; a `save_to_disk` folder is also accepted"
        )
    return builders.pop()


def train_validation_split(
    corpus: datasets.Dataset | datasets.DatasetDict, validation_percentage: float
) -> datasets.DatasetDict:
    """{"train", "validation"} of non-empty documents; an existing validation split is kept as it is."""
    if isinstance(corpus, datasets.DatasetDict):
        if "train" not in corpus:
            raise DataError(f"the dataset folder has splits {sorted(corpus)} but no 'train' split")
        if "validation" in corpus:
            return datasets.DatasetDict({name: _non_empty(corpus[name]) for name in ("train", "validation")})
        corpus = corpus["train"]
    corpus = _non_empty(corpus)
    if not 0 < validation_percentage < 100:
        raise DataError(f"--validation_split_percentage must be in (0, 100), got {validation_percentage}")
    if len(corpus) < 2:
        raise DataError(f"the corpus has {len(corpus)} non-empty document(s); at least 2 are needed to hold one out")
    split = corpus.train_test_split(test_size=validation_percentage / 100, seed=SPLIT_SEED)
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})


def _non_empty(dataset: datasets.Dataset) -> datasets.Dataset:
    kept = dataset.filter(lambda text: bool(text and text.strip()), input_columns=TEXT_COLUMN)
    if len(kept) == 0:
        raise DataError("the corpus is empty: no document has any non-blank text")
    return kept


# ---------------------------------------------------------------------------------------------------------------------
# Token blocks
# ---------------------------------------------------------------------------------------------------------------------
def tokenize_into_blocks(splits: datasets.DatasetDict, tokenizer, block_size: int) -> datasets.DatasetDict:
    """Documents joined with EOS and cut into ``block_size`` blocks; the last partial block of a split is dropped.

    Labels are the inputs: the model shifts them itself. Every block is full, so no padding and no attention mask.
    """
    if block_size < 2:
        raise DataError(f"--block_size must be >= 2, got {block_size}")

    def to_blocks(batch):
        documents = tokenizer(batch[TEXT_COLUMN])["input_ids"]
        ids = [token for document in documents for token in [*document, tokenizer.eos_token_id]]
        blocks = [ids[start : start + block_size] for start in range(0, len(ids) - block_size + 1, block_size)]
        return {"input_ids": blocks, "labels": blocks}

    # One batch per split: blocks then run across document boundaries, as in pre-training on a token stream.
    blocks = datasets.DatasetDict(
        {
            name: split.map(to_blocks, batched=True, batch_size=None, remove_columns=split.column_names)
            for name, split in splits.items()
        }
    )
    for name, split in blocks.items():
        if len(split) == 0:
            raise DataError(
                f"the {name} split has fewer than --block_size={block_size} tokens; give more text or a smaller "
                "--block_size"
            )
    return blocks
