"""Training text as ``datasets`` splits of token blocks: an embedded corpus that ships with Python, local files, or a
dataset by name (hub, ``datasets`` cache or local folder), in memory or streamed.

The embedded corpus needs no download: the Python reference manual's topic pages (``pydoc_data.topics``) plus the
docstrings of a fixed list of standard-library modules. It is deterministic for a given Python version.
"""

import bz2
import codecs
import glob
import gzip
import importlib
import inspect
import lzma
import platform
from pathlib import Path

import datasets
from datasets.exceptions import DatasetGenerationError

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
FILE_BUILDERS = {
    ".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
}  # fmt: skip
# Single-file compressions that `datasets` decompresses on the fly and the standard library reads for the UTF-8 check.
COMPRESSION_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# A text file's documents are its paragraphs: lines of one paragraph should not be cut apart by EOS tokens.
BUILDER_OPTIONS = {"text": {"sample_by": "paragraph"}}
# A stream is packed into blocks this many documents at a time (each batch's last partial block is dropped), and a new
# tokenizer learns from its first STREAM_TOKENIZER_DOCUMENTS training documents.
STREAM_PACK_DOCUMENTS = 1000
STREAM_TOKENIZER_DOCUMENTS = 10_000
# How the token blocks treat document boundaries (`tokenize_into_blocks`); the first is the default.
PACKING_MODES = ("documents", "concatenate")
# The label the loss skips (transformers' `ignore_index`).
IGNORED_LABEL = -100
# A streamed validation split has no end to evaluate up to: its first blocks are evaluated, these many by default.
STREAM_EVAL_BLOCKS = 128
# A stream starts without reading its files whole: the UTF-8 check reads this much of each.
STREAM_CHECKED_BYTES = 1 << 20


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


def load_corpus(
    data_files: list[str] | None,
    text_column: str,
    validation_percentage: float,
    *,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    streaming: bool = False,
) -> tuple[datasets.DatasetDict | datasets.IterableDatasetDict, str]:
    """Train/validation documents in column ``"text"`` and a one-line description of where they came from.

    The source is ``dataset_name`` (a hub dataset, one in the local ``datasets`` cache, or a local folder), else
    ``data_files``, else the embedded corpus. ``streaming`` reads it as ``IterableDataset`` splits, nothing loaded
    whole.
    """
    if dataset_name and data_files:
        raise DataError(
            "--dataset_name and --data_files are two sources of training text; give one: --dataset_name NAME "
            "[--dataset_config_name CONFIG], or --data_files FILE ..."
        )
    if dataset_config_name and not dataset_name:
        raise DataError(f"--dataset_config_name {dataset_config_name} needs --dataset_name (the dataset it configures)")
    if dataset_name:
        configuration = f" --dataset_config_name {dataset_config_name}" if dataset_config_name else ""
        source = f"--dataset_name {dataset_name}{configuration}"
        corpus = load_named_dataset(dataset_name, dataset_config_name, streaming, source)
        # A local folder is named by its last component only: the description is published in the model card.
        shown = Path(dataset_name).name if Path(dataset_name).exists() else dataset_name
        description = f"dataset {shown}" + (f" ({dataset_config_name})" if dataset_config_name else "")
    elif data_files:
        paths = expand_data_files(data_files)
        source = f"--data_files {', '.join(paths)}"
        corpus = load_local_corpus(paths, streaming, source)
        description = f"local files: {', '.join(Path(path).name for path in paths)}"
    else:
        source, description = "the embedded corpus", embedded_corpus_description()
        corpus = embedded_corpus()
        corpus = corpus.to_iterable_dataset() if streaming else corpus
    documents = text_documents(corpus, text_column, source)
    return train_validation_split(documents, validation_percentage), description + (", streamed" if streaming else "")


def load_named_dataset(name: str, config_name: str | None, streaming: bool, source: str):
    """``load_dataset(name, config_name)`` with all its splits; a ``save_to_disk`` folder goes to ``load_from_disk``.

    Offline (``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``) ``datasets`` serves a hub dataset from its cache.
    """
    if saved_to_disk(name):
        if config_name:
            raise DataError(f"{source}: a `save_to_disk` folder has no configurations; drop --dataset_config_name")
        return load_saved(name, streaming)
    try:
        return datasets.load_dataset(name, config_name, streaming=streaming)
    except (ConnectionError, FileNotFoundError, RuntimeError, ValueError, DatasetGenerationError) as error:
        reason = "; ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
        if isinstance(error, ConnectionError):
            reason += f", and the datasets cache ({datasets.config.HF_DATASETS_CACHE}) does not hold it"
        raise DataError(f"{source}: cannot load the dataset: {reason}") from None


def load_local_corpus(paths: list[str], streaming: bool, source: str):
    """Text, JSON(-lines), CSV or parquet files (also compressed), or one folder written by ``save_to_disk``.

    A text file gives one document per paragraph.
    """
    if len(paths) == 1 and Path(paths[0]).is_dir():
        if not saved_to_disk(paths[0]):
            raise DataError(
                f"--data_files {paths[0]} is a folder but not one written by `save_to_disk`; pass its files "
                "(e.g. 'folder/*.jsonl') or the folder as --dataset_name"
            )
        return load_saved(paths[0], streaming)
    builder = file_builder(paths)
    for path in paths:
        limit_bytes = STREAM_CHECKED_BYTES if streaming else None
        check_readable_file(path, utf8_text=builder in ("text", "json", "csv"), limit_bytes=limit_bytes)
    try:
        return datasets.load_dataset(builder, data_files=list(paths), split="train", streaming=streaming,
                                     **BUILDER_OPTIONS.get(builder, {}))
    except DatasetGenerationError as error:
        cause = error.__cause__ or error
        raise DataError(f"{source}: {builder} files cannot be read: {cause}") from None


def saved_to_disk(path: str) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return Path(path, "state.json").is_file() or Path(path, "dataset_dict.json").is_file()


def load_saved(path: str, streaming: bool):
    loaded = datasets.load_from_disk(path)
    if not streaming:
        return loaded
    if isinstance(loaded, datasets.DatasetDict):
        return datasets.IterableDatasetDict({name: split.to_iterable_dataset() for name, split in loaded.items()})
    return loaded.to_iterable_dataset()


def expand_data_files(patterns: list[str]) -> list[str]:
    """The files named or matched (glob patterns such as ``data/*.txt``, ``**`` recursing), in order, each once."""
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern) and not Path(pattern).is_file():  # `notes [v2].txt` names itself
            matches = sorted(path for path in glob.glob(pattern, recursive=True) if Path(path).is_file())
            if not matches:
                raise DataError(f"--data_files {pattern} matches no file")
            paths.extend(matches)
        elif not Path(pattern).exists():
            raise DataError(f"--data_files: no such file or folder: {pattern}")
        else:
            paths.append(pattern)
    return list(dict.fromkeys(paths))


def data_format(path: str) -> str:
    """The suffix naming a file's format, under a compression suffix: ``a.jsonl.gz`` -> ``.jsonl``."""
    suffixes = [suffix.lower() for suffix in Path(path).suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_OPENERS:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def file_builder(paths: list[str]) -> str:
    formats = {data_format(path) for path in paths}
    builders = {FILE_BUILDERS.get(suffix) for suffix in formats}
    if None in builders or len(builders) != 1:
        raise DataError(
            f"--data_files must all have one of the suffixes {', '.join(FILE_BUILDERS)} (one format per run), "
            f"optionally compressed ({', '.join(COMPRESSION_OPENERS)}); got {', '.join(sorted(formats)) or 'none'} "
            "in " + ", ".join(paths) + "; a `save_to_disk` folder is also accepted"
        )
    return builders.pop()


def check_readable_file(path: str, utf8_text: bool, limit_bytes: int | None = None, chunk_bytes: int = 1 << 20) -> None:
    """A data file must hold something; text, JSON and CSV files must be UTF-8 text (no NUL bytes), also when
    compressed. ``limit_bytes`` checks only the start of the (decompressed) file."""
    if Path(path).stat().st_size == 0:
        raise DataError(f"--data_files {path} is empty (0 bytes)")
    if not utf8_text:
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, complete = 0, True
    opener = COMPRESSION_OPENERS.get(Path(path).suffix.lower(), open)
    try:
        with opener(path, "rb") as handle:
            while chunk := handle.read(chunk_bytes):
                if b"\0" in chunk:
                    raise DataError(
                        f"--data_files {path} is binary, not text (NUL byte at offset {offset + chunk.index(0)})"
                    )
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as error:
                    raise DataError(
                        f"--data_files {path} is not UTF-8 text (byte 0x{chunk[error.start]:02x} at offset "
                        f"{offset + error.start}); convert it, e.g. with `iconv -t utf-8`"
                    ) from None
                offset += len(chunk)
                if limit_bytes is not None and offset >= limit_bytes:
                    complete = False
                    break
    except (OSError, EOFError, lzma.LZMAError) as error:
        raise DataError(f"--data_files {path} cannot be decompressed: {error}") from None
    if not complete:
        return
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"--data_files {path} is not UTF-8 text (it ends inside a multi-byte character)") from None


def text_documents(corpus, text_column: str, source: str):
    """The corpus (one split or several, in memory or streamed) reduced to its non-blank documents in column
    ``"text"``; a value that is neither text nor null stops the job naming its row."""
    splits = corpus.values() if isinstance(corpus, (datasets.DatasetDict, datasets.IterableDatasetDict)) else [corpus]
    columns = column_names(next(iter(splits)), source)
    if text_column not in columns:
        raise DataError(f"--text_column {text_column!r} is not a column of {source}; columns are {sorted(columns)}")

    def is_document(text, row: int) -> bool:
        if text is not None and not isinstance(text, str):
            raise DataError(
                f"{source}: column {text_column!r} must hold text, but row {row} holds {type(text).__name__} "
                f"{text!r:.40}"
            )
        return bool(text and text.strip())

    def documents(split):
        kept = split.select_columns([text_column]).filter(is_document, with_indices=True, input_columns=text_column)
        if isinstance(kept, datasets.Dataset) and len(kept) == 0:
            raise DataError("the corpus is empty: no document has any non-blank text")
        return kept if text_column == TEXT_COLUMN else kept.rename_column(text_column, TEXT_COLUMN)

    if isinstance(corpus, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return type(corpus)({name: documents(split) for name, split in corpus.items()})
    return documents(corpus)


def column_names(split, source: str) -> list[str]:
    """A split's columns; a stream whose features are not declared shows them in its first row."""
    if split.column_names is not None:
        return split.column_names
    first = next(iter(split), None)
    if first is None:
        raise DataError(f"{source} holds no rows")
    return list(first)


def train_validation_split(corpus, validation_percentage: float):
    """{"train", "validation"}; an existing validation split is kept as it is, else documents of train are held out.

    In memory a seeded random ``validation_percentage`` % of the documents is held out; a stream cannot be drawn
    from at random, so it holds out documents at evenly spaced positions (every 20th for 5 %).
    """
    streamed = isinstance(corpus, (datasets.IterableDataset, datasets.IterableDatasetDict))
    if isinstance(corpus, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if "train" not in corpus:
            raise DataError(f"the dataset has splits {sorted(corpus)} but no 'train' split")
        if "validation" in corpus:
            return type(corpus)({name: corpus[name] for name in ("train", "validation")})
        corpus = corpus["train"]
    if not 0 < validation_percentage < 100:
        raise DataError(f"--validation_split_percentage must be in (0, 100), got {validation_percentage}")
    if streamed:
        def held_out(_, index: int) -> bool:
            return (index + 1) * validation_percentage // 100 > index * validation_percentage // 100

        return datasets.IterableDatasetDict({
            "train": corpus.filter(lambda text, index: not held_out(text, index), with_indices=True,
                                   input_columns=TEXT_COLUMN),
            "validation": corpus.filter(held_out, with_indices=True, input_columns=TEXT_COLUMN),
        })  # fmt: skip
    if len(corpus) < 2:
        raise DataError(f"the corpus has {len(corpus)} non-empty document(s); at least 2 are needed to hold one out")
    split = corpus.train_test_split(test_size=validation_percentage / 100, seed=SPLIT_SEED)
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})


def tokenizer_documents(split) -> list[str]:
    """The documents a new tokenizer is trained on: the whole train split, or a stream's first ones."""
    if isinstance(split, datasets.IterableDataset):
        texts = [row[TEXT_COLUMN] for row in split.take(STREAM_TOKENIZER_DOCUMENTS)]
        if not texts:
            raise DataError("the corpus is empty: the train stream has no document with non-blank text")
        return texts
    return split[TEXT_COLUMN]


# ---------------------------------------------------------------------------------------------------------------------
# Token blocks
# ---------------------------------------------------------------------------------------------------------------------
def tokenize_into_blocks(splits, tokenizer, block_size: int, packing: str = "documents"):
    """Documents joined with EOS and cut into ``block_size`` blocks; the last partial block of a split is dropped.

    ``packing="documents"`` keeps the document boundaries in the layout of transformers' ``DataCollatorWithFlattening``
    (`packed_positions_and_labels`): the model reads the restarting ``position_ids`` and starts every document from a
    fresh state, so no document is trained on its neighbours' context. ``"concatenate"`` gives blocks that run
    across documents, as in pre-training on one token stream: labels are the inputs, and no position ids.
    Every block is full, so no padding and no attention mask. A streamed split is packed on the fly,
    STREAM_PACK_DOCUMENTS documents at a time.
    """
    if block_size < 2:
        raise DataError(f"--block_size must be >= 2, got {block_size}")
    if packing not in PACKING_MODES:
        raise DataError(f"--packing must be one of {', '.join(PACKING_MODES)}, got {packing!r}")

    def to_blocks(batch):
        documents = tokenizer(batch[TEXT_COLUMN])["input_ids"]
        ids = [token for document in documents for token in [*document, tokenizer.eos_token_id]]
        starts = [index == 0 for document in documents for index in range(len(document) + 1)]
        cuts = range(0, len(ids) - block_size + 1, block_size)
        blocks = [ids[start : start + block_size] for start in cuts]
        if packing == "concatenate":
            return {"input_ids": blocks, "labels": blocks}
        packed = (packed_positions_and_labels(block, starts[start:]) for block, start in zip(blocks, cuts))
        positions, labels = zip(*packed) if blocks else ((), ())
        return {"input_ids": blocks, "position_ids": list(positions), "labels": list(labels)}

    def blocks_of(name, split):
        # In memory, one batch per split, so only the split's last partial block is dropped.
        batch_size = STREAM_PACK_DOCUMENTS if isinstance(split, datasets.IterableDataset) else None
        blocks = split.map(to_blocks, batched=True, batch_size=batch_size, remove_columns=[TEXT_COLUMN])
        empty = next(iter(blocks), None) is None if isinstance(blocks, datasets.IterableDataset) else len(blocks) == 0
        if empty:
            raise DataError(
                f"the {name} split has fewer than --block_size={block_size} tokens; give more text or a smaller "
                "--block_size"
            )
        return blocks

    return type(splits)({name: blocks_of(name, split) for name, split in splits.items()})


def packed_positions_and_labels(block: list[int], document_starts: list[bool]) -> tuple[list[int], list[int]]:
    """Position ids that count from 0 at every document start and at the block's first token (a document cut by the
    block boundary goes on as a new one), and labels that are the tokens except -100 wherever a count starts: a
    document's first token has nothing of its own before it to be predicted from."""
    positions, labels = [], []
    for index, (token, starts) in enumerate(zip(block, document_starts)):
        positions.append(0 if starts or index == 0 else positions[-1] + 1)
        labels.append(IGNORED_LABEL if positions[-1] == 0 else token)
    return positions, labels


def evaluation_blocks(blocks, limit: int | None) -> datasets.Dataset:
    """The first ``limit`` blocks in memory (None: all of them, or a stream's first STREAM_EVAL_BLOCKS). A streamed
    split is read once, here, so that every evaluation ends and sees the same blocks."""
    if isinstance(blocks, datasets.IterableDataset):
        return datasets.Dataset.from_list(list(blocks.take(limit or STREAM_EVAL_BLOCKS)))
    return blocks if limit is None or limit >= len(blocks) else blocks.select(range(limit))
