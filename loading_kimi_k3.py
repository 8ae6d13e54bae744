"""Strict loading of Kimi K3 checkpoints, either layout (``checkpoint_format_kimi_k3.py``): the files a folder may
hand a loader, the checkpoint's headers, every tensor matched against the model before any is read, and transformers'
load through the released layout's transforms.

transformers only warns about missing or unexpected tensors and casts stored dtypes silently; here a checkpoint that
does not hold exactly the model's tensors is refused in one ``ValueError`` naming each offending tensor, unless
``from_pretrained(..., strict=False)``. Shipped beside the model file; it imports only torch, safetensors, transformers
and its sibling checkpoint-format file.
"""

import contextvars
import json
import os
import re
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from transformers.utils import logging

try:
    from .checkpoint_format_kimi_k3 import (
        MXFP4_GROUP_SIZE,
        RELEASE_MULTIMODAL_PREFIXES,
        RELEASE_TEXT_PREFIX,
        ROUTED_EXPERT_WEIGHT,
        checkpoint_shapes,
        dequantize_mxfp4,
        is_released_layout,
        released_layout_transforms,
    )
except ImportError:
    from checkpoint_format_kimi_k3 import (
        MXFP4_GROUP_SIZE,
        RELEASE_MULTIMODAL_PREFIXES,
        RELEASE_TEXT_PREFIX,
        ROUTED_EXPERT_WEIGHT,
        checkpoint_shapes,
        dequantize_mxfp4,
        is_released_layout,
        released_layout_transforms,
    )

logger = logging.get_logger(__name__)

_MAX_REPORTED_PROBLEMS = 20
# `from_pretrained(..., strict=False)` switches the checkpoint checks off for the duration of that call.
STRICT_LOADING = contextvars.ContextVar("kimi_k3_strict_loading", default=True)
# Stored dtypes of floating-point tensors (safetensors names); integer or boolean data where the model holds floats
# would be cast silently.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# E8M0 scales from this byte on can decode to infinity in fp32/bf16: 6 · 2^(253 − 127) = 1.5 · 2^128; 255 is NaN.
_FIRST_OVERFLOWING_SCALE = 253


# ---------------------------------------------------------------------------------------------------------------------
# Files read from a folder
# ---------------------------------------------------------------------------------------------------------------------
# The most a loader reads whole from a JSON file (shard index, config, tokenizer files): safetensors' own bound on a
# header, which the released model's index (about 30 MB) and the largest tokenizers stay far below.
MAX_JSON_FILE_BYTES = 100_000_000
# What `from_pretrained` opens from a local folder besides the shards its index names.
FOLDER_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")  # fmt: skip
# What `AutoTokenizer.from_pretrained` reads whole from a folder, besides any ``tokenizer*`` file.
TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def folder_root(folder: str | os.PathLike) -> str:
    """The folder links may resolve into: the folder itself, or for a snapshot of the hub cache
    (``models--x--y/snapshots/<revision>``, whose files link to ``../../blobs``) the repository's cache folder."""
    root = os.path.realpath(folder)
    repository = os.path.dirname(os.path.dirname(root))
    if os.path.basename(os.path.dirname(root)) == "snapshots" and os.path.isdir(os.path.join(repository, "blobs")):
        return repository
    return root


def checked_regular_file(path: str | os.PathLike, root: str | None = None, max_bytes: int | None = None) -> str:
    """``path`` if it is a regular file (inside ``root`` once links are resolved, no larger than ``max_bytes``), else
    one ``ValueError`` naming it. Checked before anything opens it: a FIFO blocks the reader forever, a device such as
    ``/dev/zero`` reads until memory runs out, and a link or ``..`` out of the folder reads another file."""
    path = str(path)
    resolved = os.path.realpath(path)
    if root is not None and os.path.commonpath([root, resolved]) != root:
        raise ValueError(f"{path} resolves to {resolved}, outside {root}: a folder's files must lie inside it.")
    try:
        status = os.stat(resolved)
    except OSError as error:
        raise ValueError(f"{path} cannot be read: {error.strerror}.") from None
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"{path} is not a regular file (a FIFO, device, socket or folder); refusing to read it.")
    if max_bytes is not None and status.st_size > max_bytes:
        raise ValueError(f"{path} holds {status.st_size:,} bytes, more than the {max_bytes:,} read whole at most.")
    return path


def shard_index_files(index_path: str, root: str | None = None) -> list[str]:
    """The shard files an index (``model.safetensors.index.json``) names, each checked to be a regular file inside
    the index's folder; a malformed index is refused naming it."""
    checked_regular_file(index_path, root, MAX_JSON_FILE_BYTES)
    try:
        with open(index_path, encoding="utf-8") as file:
            shard_names = set(json.load(file)["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index_path} is not a shard index (a JSON object with a `weight_map`): {error!r}") from None
    if not all(isinstance(name, str) for name in shard_names):
        raise ValueError(f"{index_path}: every `weight_map` value must be a file name.")
    folder = os.path.dirname(index_path)
    return [checked_regular_file(os.path.join(folder, name), root) for name in sorted(shard_names)]


def check_local_folder(folder: str | os.PathLike) -> None:
    """Everything `from_pretrained` will open from a local folder, checked with `checked_regular_file` before
    transformers opens any of it (transformers joins index entries to the folder as they are)."""
    root = folder_root(folder)
    for name in FOLDER_FILES:
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            if name.endswith(".index.json"):
                shard_index_files(path, root)
            else:
                checked_regular_file(path, root, MAX_JSON_FILE_BYTES if name.endswith(".json") else None)


_SAFETENSORS_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
    torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
}  # fmt: skip


class CheckpointEntry(NamedTuple):
    path: str
    shape: tuple[int, ...]
    dtype: str  # safetensors name: "BF16", "F32", "U8", ...


def read_safetensors_headers(shard_files: list[str]) -> dict[str, CheckpointEntry]:
    """Shard, shape and dtype of every tensor of a (sharded) checkpoint, read from the headers only."""
    entries = {}
    for path in shard_files:
        try:
            with safe_open(path, framework="pt") as shard:
                for name in shard.keys():
                    tensor = shard.get_slice(name)
                    entries[name] = CheckpointEntry(str(path), tuple(tensor.get_shape()), tensor.get_dtype())
        except SafetensorError as error:
            raise ValueError(f"Checkpoint shard {path} cannot be read (truncated or corrupted?): {error}") from error
    return entries


def read_torch_headers(shard_files: list[str]) -> dict[str, CheckpointEntry]:
    """The same for ``pytorch_model.bin`` shards, read onto the meta device: names, shapes and dtypes, no data."""
    entries = {}
    for path in shard_files:
        try:
            state_dict = torch.load(path, map_location="meta", weights_only=True)
        except Exception as error:  # torch reports a corrupt zip or pickle in many classes
            raise ValueError(f"Checkpoint shard {path} cannot be read (truncated or corrupted?): {error}") from error
        for name, tensor in state_dict.items():
            dtype = _SAFETENSORS_DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
            entries[name] = CheckpointEntry(str(path), tuple(tensor.shape), dtype)
    return entries


def read_checkpoint_headers(shard_files: list[str]) -> dict[str, CheckpointEntry] | None:
    """Every tensor of safetensors or ``.bin`` shards; None for a mix, which transformers' own loader reads."""
    if all(str(path).endswith(".safetensors") for path in shard_files):
        return read_safetensors_headers(shard_files)
    if all(str(path).endswith(".bin") for path in shard_files):
        return read_torch_headers(shard_files)
    return None


def read_checkpoint_tensor(entries: dict[str, CheckpointEntry], name: str) -> torch.Tensor:
    path = entries[name].path
    if path.endswith(".bin"):
        return torch.load(path, mmap=True, weights_only=True)[name]
    with safe_open(path, framework="pt") as shard:
        return shard.get_tensor(name)


def base_model_entries(model, entries: dict[str, "CheckpointEntry"]) -> dict[str, "CheckpointEntry"]:
    """``entries`` without a task model's head when ``model`` is the base model: transformers loads a base model from
    a task folder by reading its ``model.*`` tensors only (the head belongs to no part of the base model)."""
    base_prefix = f"{model.base_model_prefix}."
    text = {name: entry for name, entry in entries.items() if not name.startswith(RELEASE_MULTIMODAL_PREFIXES)}
    names = [name.removeprefix(RELEASE_TEXT_PREFIX) for name in text]
    if model.base_model is not model or not any(name.startswith(base_prefix) for name in names):
        return entries
    return {
        name: entry
        for name, entry in entries.items()
        if name.startswith(RELEASE_MULTIMODAL_PREFIXES) or name.removeprefix(RELEASE_TEXT_PREFIX).startswith(base_prefix)
    }


def match_checkpoint_tensors(
    entries: dict[str, CheckpointEntry],
    expected: dict[str, tuple[int, ...]],
    read_tensor: Callable[[str], torch.Tensor],
    reshaped_ok: bool = False,
) -> dict[str, tuple[str, ...]]:
    """Match a checkpoint in either layout against ``expected`` (`checkpoint_shapes`); refuse it, naming every
    offending tensor, unless each text tensor is present with its shape and a floating-point dtype (MXFP4 pairs:
    uint8, with scales that decode to finite values) and nothing else is.

    Returns, for each expected name, the stored tensors that hold it: itself, or (weight_packed, weight_scale).
    ``reshaped_ok`` (``from_pretrained(..., ignore_mismatched_sizes=True)``) lets a tensor stored with another shape
    through, for transformers to initialise anew (a classifier with another number of labels).
    An expert counts as MXFP4 exactly when its `weight_packed` exists: the release's `quantization_config.ignore`
    list does not name every dense tensor. A longer 1-D `A_log` must be zero past num_heads.
    Vision and projector tensors (never under the text prefix) are expected when ``expected`` names them (the
    vision-language model), else skipped with one log line.
    """
    prefix = RELEASE_TEXT_PREFIX if any(name.startswith(RELEASE_TEXT_PREFIX) for name in entries) else ""
    sees = any(name.startswith(RELEASE_MULTIMODAL_PREFIXES) for name in expected)
    skipped = Counter(p for name in entries for p in RELEASE_MULTIMODAL_PREFIXES if name.startswith(p))
    if skipped and not sees:
        counts = ", ".join(f"{skipped[p]} {p}* tensors" for p in RELEASE_MULTIMODAL_PREFIXES if skipped[p])
        logger.warning(f"Skipping the multimodal part of the checkpoint (the text model has no use for it): {counts}.")
    unclaimed = {name for name in entries if sees or not name.startswith(RELEASE_MULTIMODAL_PREFIXES)}
    sources, problems = {}, []
    for name, shape in expected.items():
        key = name if name.startswith(RELEASE_MULTIMODAL_PREFIXES) else prefix + name
        if ROUTED_EXPERT_WEIGHT.search(name) and f"{key}_packed" in entries:
            stored = (f"{key}_packed", f"{key}_scale")
            problems += _mxfp4_problems(entries, stored, shape, read_tensor)
        elif key in entries:
            stored = (key,)
            problems += _shape_problems(entries[key], key, entries[key].shape if reshaped_ok else shape, read_tensor)
        else:
            problems.append(f"missing {key} {list(shape)}")
            continue
        sources[name] = stored
        unclaimed.difference_update(stored)
    problems += [f"unexpected {name} {list(entries[name].shape)}" for name in sorted(unclaimed)]
    if problems:
        raise ValueError(_refusal(problems))
    return sources


def _refusal(problems: list[str]) -> str:
    listed = "; ".join(problems[:_MAX_REPORTED_PROBLEMS])
    more = len(problems) - _MAX_REPORTED_PROBLEMS
    return (
        f"Refusing the checkpoint: {len(problems)} text tensor(s) do not match the model: {listed}"
        + (f"; ... and {more} more" if more > 0 else "")
        + " (from_pretrained(..., strict=False) loads it anyway, initialising what is missing)."
    )


def _mxfp4_problems(entries, stored: tuple[str, str], shape: tuple[int, ...], read_tensor) -> list[str]:
    rows, columns = shape
    wanted = dict(zip(stored, [(rows, columns // 2), (rows, columns // MXFP4_GROUP_SIZE)]))
    problems = []
    for name, want in wanted.items():
        entry = entries.get(name)
        if entry is None:
            problems.append(f"missing {name} {list(want)}")
        elif entry.shape != want or entry.dtype != "U8":
            problems.append(f"{name}: expected U8 {list(want)}, found {entry.dtype} {list(entry.shape)}")
    return problems or _nonfinite_scale_problems(stored, read_tensor)


def _nonfinite_scale_problems(stored: tuple[str, str], read_tensor) -> list[str]:
    """E8M0 byte 255 is NaN, and a byte >= 253 times a large E2M1 code overflows fp32 and bf16."""
    packed, scale = stored
    scales = read_tensor(scale)
    if int(scales.max()) < _FIRST_OVERFLOWING_SCALE:
        return []
    dense = dequantize_mxfp4(read_tensor(packed), scales, torch.float32)
    bad_groups = ~torch.isfinite(dense.view(*scales.shape, MXFP4_GROUP_SIZE)).all(-1)
    if not bad_groups.any():
        return []
    nan_scales = int((scales == 255).sum())
    return [
        f"{scale}: {int(bad_groups.sum())} group(s) decode to non-finite values (E8M0 scale byte 255 = NaN in "
        f"{nan_scales} group(s), largest byte {int(scales.max())})"
    ]


def _shape_problems(entry: CheckpointEntry, key: str, shape: tuple[int, ...], read_tensor) -> list[str]:
    if entry.dtype not in _FLOAT_DTYPES:
        return [f"{key}: stored as {entry.dtype}, expected a floating-point dtype {list(_FLOAT_DTYPES)}"]
    if key.endswith("A_log") and len(entry.shape) == 1 and entry.shape[0] > shape[0]:
        tail = read_tensor(key)[shape[0] :]
        if tail.any():
            return [
                f"{key}: stored zero-padded to {entry.shape[0]}, but entries {shape[0]}..{entry.shape[0] - 1} are not "
                f"zero (max |x| = {tail.abs().max().item():.4g}); the model has {shape[0]} heads"
            ]
        return []
    return [] if entry.shape == shape else [f"{key}: expected shape {list(shape)}, found {list(entry.shape)}"]


def verify_checkpoint_entries(model, entries: dict[str, CheckpointEntry], reshaped_ok: bool = False) -> None:
    """Refuse a checkpoint (either layout) that does not hold exactly ``model``'s tensors, naming each offender.

    As in transformers, a model class's ``_keys_to_ignore_on_load_missing`` names tensors it may initialise (a new task
    head), ``_keys_to_ignore_on_load_unexpected`` tensors it may leave unread, and ``reshaped_ok``
    (``ignore_mismatched_sizes``) lets tensors of another shape be initialised anew.
    """
    missing_ok = _any_pattern(model._keys_to_ignore_on_load_missing)
    unexpected_ok = _any_pattern(model._keys_to_ignore_on_load_unexpected)
    entries = {
        name: entry
        for name, entry in base_model_entries(model, entries).items()
        if name.startswith(RELEASE_MULTIMODAL_PREFIXES) or not unexpected_ok(name.removeprefix(RELEASE_TEXT_PREFIX))
    }
    stored = {name.removeprefix(RELEASE_TEXT_PREFIX) for name in entries}
    expected = {
        name: shape for name, shape in checkpoint_shapes(model, entries).items() if name in stored or not missing_ok(name)
    }
    match_checkpoint_tensors(entries, expected, partial(read_checkpoint_tensor, entries), reshaped_ok)


def _any_pattern(patterns) -> Callable[[str], bool]:
    compiled = [re.compile(pattern) for pattern in patterns or ()]
    return lambda name: any(pattern.search(name) for pattern in compiled)


def verify_checkpoint_files(model, checkpoint_files: list[str]) -> None:
    """`verify_checkpoint_entries` for safetensors shards on disk, e.g. a Trainer checkpoint about to be resumed."""
    verify_checkpoint_entries(model, read_safetensors_headers(checkpoint_files))


def load_checkpoint(load: Callable, model, state_dict, checkpoint_files, load_config, expected_keys):
    """``PreTrainedModel._load_pretrained_model`` (``load``) after checking the checkpoint (either layout) against the
    model; a released-layout checkpoint is read through the release transforms, ours through the stock path.

    transformers only warns about missing or unexpected tensors; `match_checkpoint_tensors` names every offending
    tensor before any is read, unless `STRICT_LOADING` is off.
    """
    strict = STRICT_LOADING.get()
    entries = None
    for path in checkpoint_files or ():
        checked_regular_file(path)  # a hub download or a path transformers resolved: links are the cache's own
    if state_dict is None and checkpoint_files:
        entries = read_checkpoint_headers(checkpoint_files)
    released = entries is not None and is_released_layout(entries)
    if strict and entries is not None:
        verify_checkpoint_entries(model, entries, reshaped_ok=load_config.ignore_mismatched_sizes)
    if released:
        load_config = replace(
            load_config, weight_mapping=[*released_layout_transforms(), *(load_config.weight_mapping or [])]
        )
    loaded = load(model, state_dict, checkpoint_files, load_config, expected_keys)
    if released:
        model._weight_conversions = None  # the transforms are load-only: `save_pretrained` writes our layout again
    if strict:
        _refuse_incomplete_load(model, loaded[0])
    return loaded


def _refuse_incomplete_load(model, loading_info) -> None:
    """What the header check cannot see (an in-memory ``state_dict``, failed conversions) is refused after loading.
    Tied copies (``lm_head.weight`` with ``tie_word_embeddings``) are stored once and tied after this check."""
    missing_ok = _any_pattern(model._keys_to_ignore_on_load_missing)
    missing = loading_info.missing_keys - model.all_tied_weights_keys.keys()
    problems = [f"missing {name}" for name in sorted(missing) if not missing_ok(name)]
    initialised = sorted(name for name in missing if missing_ok(name))
    if initialised and not problems:
        logger.warning(
            f"{type(model).__name__}: {', '.join(initialised)} not in the checkpoint, initialised at random (a new "
            "task head): train it before use."
        )
    problems += [f"{name}: {error.strip().splitlines()[-1]}" for name, error in loading_info.conversion_errors.items()]
    if problems:
        raise ValueError(_refusal(problems))
