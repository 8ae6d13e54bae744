"""Streaming conversion of whole folders between our ``save_pretrained`` layout and the released Kimi-K3 layout.

The formats themselves (released names and shapes, MXFP4, the expert layout, the strict matcher) are defined in
``checkpoint_format_kimi_k3.py``, which ships with the model. Released: a multimodal wrapper ``config.json``,
``language_model.`` text tensors, MXFP4 routed experts, zero-padded ``A_log``. Ours: the flat `KimiK3Config`, ``model.*``/``lm_head.*``, one dense
``experts.{e}.w1/w2/w3.weight`` per expert, ``A_log`` [num_heads].

Both directions check the input with the loader's own rules (`match_checkpoint_tensors`), plan every output tensor
from the input headers, then stream: input tensors are read one at a time with one input shard mapped at a time,
and each output shard is written as soon as it is complete, so peak memory stays near one output shard.
"""

import copy
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub import split_state_dict_into_shards_factory
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE, SAFETENSORS_WEIGHTS_FILE_PATTERN
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers.dynamic_module_utils import custom_object_save

from checkpoint_format_kimi_k3 import (
    EXPERT_LAYOUT,
    MXFP4_GROUP_SIZE,
    RELEASE_MULTIMODAL_PREFIXES,
    RELEASE_TEXT_PREFIX,
    ROUTED_EXPERT_WEIGHT,
    checkpoint_shapes,
    dequantize_mxfp4,
    is_released_layout,
    quantize_mxfp4,
    released_tensor_shapes,
)
from configuration_kimi_k3 import AUTO_MAP, VISION_AUTO_MAP, KimiK3Config
from loading_kimi_k3 import (
    CheckpointEntry,
    check_local_folder,
    checked_regular_file,
    folder_root,
    match_checkpoint_tensors,
    read_safetensors_headers,
    shard_index_files,
)
from modeling_kimi_k3 import KimiK3ForCausalLM
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration, KimiK3PatchMergerProjector, KimiK3VisionTower
from processing_kimi_k3 import KimiK3Processor
from variants_kimi_k3 import BASIS_OF_EXPERT_TENSOR, causal_lm_class, materialise_experts

from kimi_k3.checkpoint import run_folder

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "check_exportable", "export_released", "import_released"]

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
CONVERSION_LOCK_SUFFIX = ".converting.lock"
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
}

# The release's `quantization_config` (inside `text_config`): only routed experts are packed.
RELEASED_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "group",
                "group_size": MXFP4_GROUP_SIZE,
                "scale_dtype": "torch.uint8",
                "dynamic": False,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}


def released_config_dict(config) -> dict:
    """The release's multimodal wrapper ``config.json`` around ``config`` as its ``text_config``, beside its
    ``vision_config`` and the token ids the wrapper repeats from it, where the model sees."""
    text_config = config.to_dict()
    vision_config = text_config.pop("vision_config", None)
    for local in ("auto_map", "layer_types", "mlp_layer_types", "_name_or_path"):  # ours, derived or machine-local
        text_config.pop(local, None)
    text_config.update(
        model_type="kimi_linear",
        architectures=["KimiLinearForCausalLM"],
        quantization_config=RELEASED_QUANTIZATION_CONFIG,
    )
    shared = ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "tie_word_embeddings", "transformers_version")
    wrapper = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        # Our code, shipped beside the weights, reads this layout: the folder loads with trust_remote_code.
        "auto_map": dict(AUTO_MAP),
        **{key: text_config[key] for key in shared if key in text_config},
        "text_config": text_config,
    }
    if vision_config is not None:
        wrapper["auto_map"].update(VISION_AUTO_MAP)
        wrapper.update({key: vision_config[key] for key in ("media_placeholder_token_id", "ignore_index")})
        wrapper["vision_config"] = vision_config
    return wrapper

# ---------------------------------------------------------------------------------------------------------------------
# The two directions
# ---------------------------------------------------------------------------------------------------------------------
def export_released(
    source: str | Path, target: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True
) -> list[str]:
    """Our ``save_pretrained`` folder -> the released layout; returns the written shard file names.

    Shared-basis experts are written as the released per-expert matrices they materialise, W_e = sum_j C[e, j] B_j;
    the other variants are refused (`check_exportable`).
    """
    source = _source_folder(source)
    config = KimiK3Config.from_pretrained(source)
    check_exportable(config)
    entries, read = _open_checkpoint(source)
    if _is_released(entries, config):
        raise ValueError(f"{source} is already in the released layout (`language_model.` / `weight_packed` tensors).")
    expected = _checkpoint_shapes(config)
    sources = match_checkpoint_tensors(entries, expected, read)
    released = _materialised_config(config)
    steps, last_bank = [], {}
    for name, stored in _in_shard_order(sources, entries):
        if name.startswith(RELEASE_MULTIMODAL_PREFIXES):  # dense in both layouts, under the same names
            steps.append(_import_step(name, stored, expected[name], entries, read, None))
        elif name.rpartition(".")[2] in BASIS_OF_EXPERT_TENSOR:
            steps += _materialised_expert_steps(name, sources, expected, read, released, last_bank)
        elif not name.endswith("_coefficients"):
            steps.append(_export_step(name, stored, expected[name], entries, read, released))

    def write(folder: Path) -> list[str]:
        shards = _write_checkpoint(steps, folder, max_shard_bytes, progress, desc="to released layout")
        (folder / "config.json").write_text(json.dumps(released_config_dict(released), indent=2, sort_keys=True) + "\n")
        return shards

    return _publish(source, target, write, vision=config.vision_config is not None)


def import_released(
    source: str | Path, target: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True
) -> list[str]:
    """A released-layout folder -> our ``save_pretrained`` layout; returns the written shard file names.

    MXFP4 experts are dequantized to the config's dtype (bf16 in the release, where it is exact); every other tensor
    keeps its stored dtype. Vision and projector tensors are kept, and the text tensors keep their `language_model.`
    prefix, when the config has a ``vision_config`` (the vision-language model's names); else they are dropped.
    """
    source = _source_folder(source)
    config = KimiK3Config.from_pretrained(source)
    entries, read = _open_checkpoint(source)
    if not _is_released(entries, config):
        raise ValueError(f"{source} is not in the released layout (no `language_model.` or `weight_packed` tensors).")
    expected = _checkpoint_shapes(config)
    sources = match_checkpoint_tensors(entries, expected, read)
    dense_dtype = config.dtype or torch.bfloat16
    sees = config.vision_config is not None
    steps = [
        _import_step(name, stored, expected[name], entries, read, dense_dtype,
                     key=RELEASE_TEXT_PREFIX + name if sees and not name.startswith(RELEASE_MULTIMODAL_PREFIXES) else name)
        for name, stored in _in_shard_order(sources, entries)
    ]  # fmt: skip

    def write(folder: Path) -> list[str]:
        shards = _write_checkpoint(steps, folder, max_shard_bytes, progress, desc="to our layout")
        config.architectures = [(KimiK3ForConditionalGeneration if sees else KimiK3ForCausalLM).__name__]
        config.save_pretrained(folder)
        return shards

    return _publish(source, target, write, vision=sees)


def _is_released(entries: dict[str, CheckpointEntry], config: KimiK3Config) -> bool:
    """Our vision-language folders name text tensors as the release does (`language_model.`); only MXFP4 experts
    tell the layouts apart there."""
    if config.vision_config is None:
        return is_released_layout(entries)
    return any(name.endswith(".weight_packed") for name in entries)


def _source_folder(source: str | Path) -> Path:
    """``source`` as a checkpoint folder whose files (the shards its index names included) are all regular files
    inside it, checked before anything is read or written: a link out of it would copy another file into the
    converted folder, a FIFO would block the reader, and a missing folder would reach the hub as a repository id."""
    source = Path(source)
    if not source.is_dir():
        raise ValueError(f"{source} is not a folder; give the checkpoint folder to convert.")
    check_local_folder(source)
    root = folder_root(source)
    for path in source.iterdir():
        if not path.is_dir():
            checked_regular_file(path, root)
    return source


def _publish(source: Path, target: str | Path, write: Callable[[Path], list[str]], vision: bool = False) -> list[str]:
    """Write the converted folder under a unique hidden name beside ``target``, with the code files that let it load
    through ``trust_remote_code`` (the vision-language model's and processor's too, with ``vision``), then rename it
    into place: a failed conversion leaves no partial ``target``."""
    target = Path(target).absolute()
    with _conversion_lock(target):
        _absent_or_empty(target)
        removed = run_folder.remove_stale_staging(target)
        if removed:
            print(f"removed {', '.join(removed)}, left beside {target} by a killed conversion", file=sys.stderr)
        staging = target.with_name(run_folder.staging_name(target.name, run_folder.new_tag()))
        staging.mkdir()
        try:
            shards = write(staging)
            for code in (KimiK3ForCausalLM, KimiK3ForConditionalGeneration, KimiK3Processor)[: 3 if vision else 1]:
                custom_object_save(code, staging)  # the model file and the files it imports relatively
            _copy_auxiliary_files(source, staging)
            run_folder.replace_folder(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return shards


@contextmanager
def _conversion_lock(target: Path):
    """One conversion at a time into ``target``: a second one would replace the first one's finished folder."""
    lock = run_folder.OutputFolderLock(target.parent, f".{target.name}{CONVERSION_LOCK_SUFFIX}")
    try:
        lock.acquire()
    except run_folder.FolderBusyError:
        raise ValueError(f"another conversion is writing {target}; wait for it, or choose another target") from None
    try:
        yield
    finally:
        lock.release()


# ---------------------------------------------------------------------------------------------------------------------
# Planning: one step per checkpoint tensor of ours, with the output tensors it becomes
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Step:
    outputs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    make: Callable[[], dict[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.outputs.values())


def _export_step(name, stored, shape, entries, read, config) -> _Step:
    planned = released_tensor_shapes(name, shape, config)
    if ROUTED_EXPERT_WEIGHT.search(name):
        outputs = {key: (packed_shape, torch.uint8) for key, packed_shape in planned.items()}
        return _Step(outputs, lambda: dict(zip(planned, quantize_mxfp4(_model_tensor(read, stored, shape), name=name))))
    ((key, released_shape),) = planned.items()
    dtype = _torch_dtype(entries, stored[0])

    def make() -> dict[str, torch.Tensor]:
        tensor = _model_tensor(read, stored, shape)
        # Only A_log changes shape: zero padding at the end.
        return {key: tensor if released_shape == shape else F.pad(tensor, (0, released_shape[0] - shape[0]))}

    return _Step({key: (released_shape, dtype)}, make)


def check_exportable(config: KimiK3Config, purpose: str = "export_released") -> None:
    """The released layout holds the released architecture: shared-basis experts materialise into it; the other
    variants have weights or a routing rule it cannot represent (the release's code would compute another model)."""
    refused = [variant for variant in config.enabled_variants if "expert_basis_size" not in variant]
    if refused:
        raise ValueError(
            f"{purpose}: the released layout cannot represent {refused[0]}; keep this project's layout "
            "(save_pretrained), which loads with trust_remote_code."
        )


def _materialised_config(config: KimiK3Config) -> KimiK3Config:
    """The released-architecture configuration of a shared-basis model (independent experts)."""
    released = copy.deepcopy(config)
    released.expert_basis_size = None
    return released


def _materialised_expert_steps(basis_name, sources, expected, read, config, last_bank: dict) -> list[_Step]:
    """One step per expert and released matrix of a shared-basis bank: W_e = sum_j C[e, j] B_j, then MXFP4.

    ``last_bank`` keeps the bank read last: its experts are written one after another, so each bank is read once and
    only one is held at a time."""
    stem, _, bank = basis_name.rpartition(".")
    fused = BASIS_OF_EXPERT_TENSOR[bank]
    coefficients_name = f"{stem}.{bank.removesuffix('_basis')}_coefficients"
    basis_shape, (num_experts, _) = expected[basis_name], expected[coefficients_name]
    rows = basis_shape[1] // len(EXPERT_LAYOUT[fused])

    def bank_tensors() -> tuple[torch.Tensor, torch.Tensor]:
        if last_bank.get("name") != basis_name:
            last_bank.clear()
            last_bank.update(name=basis_name, tensors=(
                _model_tensor(read, sources[coefficients_name], expected[coefficients_name]),
                _model_tensor(read, sources[basis_name], basis_shape),
            ))  # fmt: skip
        return last_bank["tensors"]

    def step(expert: int, index: int, part: str) -> _Step:
        name = f"{stem}.{expert}.{part}.weight"
        planned = released_tensor_shapes(name, (rows, basis_shape[2]), config)

        def make() -> dict[str, torch.Tensor]:
            coefficients, basis = bank_tensors()
            weight = materialise_experts(coefficients[expert : expert + 1], basis)[0, index * rows : (index + 1) * rows]
            return dict(zip(planned, quantize_mxfp4(weight, name=name)))

        return _Step({key: (shape, torch.uint8) for key, shape in planned.items()}, make)

    return [step(e, i, part) for e in range(num_experts) for i, part in enumerate(EXPERT_LAYOUT[fused])]


def _import_step(name, stored, shape, entries, read, dense_dtype, key: str | None = None) -> _Step:
    """The tensor ``name`` as the model holds it, written under ``key`` (default ``name``)."""
    key, dtype = key or name, dense_dtype if len(stored) == 2 else _torch_dtype(entries, stored[0])
    return _Step({key: (shape, dtype)}, lambda: {key: _model_tensor(read, stored, shape, dtype)})


def _model_tensor(read, stored: tuple[str, ...], shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    """The tensor as the model holds it: dequantized when stored as MXFP4, narrowed when stored zero-padded."""
    if len(stored) == 2:
        return dequantize_mxfp4(read(stored[0]), read(stored[1]), dtype)
    tensor = read(stored[0])
    if tuple(tensor.shape) != shape:  # A_log stored zero-padded
        tensor = tensor[: shape[0]]
    # safetensors hands out views of the mapped file: copy, so that no output keeps an input shard mapped.
    return tensor.clone()


def _checkpoint_shapes(config: KimiK3Config) -> dict[str, tuple[int, ...]]:
    """The text model's checkpoint names and shapes, and the vision tower's and projector's where it sees."""
    with torch.device("meta"):
        shapes = checkpoint_shapes(causal_lm_class(config)(config))
        if config.vision_config is not None:
            for prefix, part in (("vision_tower", KimiK3VisionTower), ("mm_projector", KimiK3PatchMergerProjector)):
                state = part(config.vision_config).state_dict()
                shapes.update({f"{prefix}.{name}": tuple(tensor.shape) for name, tensor in state.items()})
    return shapes


def _in_shard_order(sources: dict, entries: dict[str, CheckpointEntry]) -> list[tuple[str, tuple[str, ...]]]:
    """Sort by input shard so that reading maps each shard once."""
    shard_rank = {path: rank for rank, path in enumerate(dict.fromkeys(entry.path for entry in entries.values()))}
    return sorted(sources.items(), key=lambda item: shard_rank[entries[item[1][0]].path])


def _torch_dtype(entries: dict[str, CheckpointEntry], name: str) -> torch.dtype:
    stored = entries[name].dtype
    if stored not in _SAFETENSORS_DTYPES:
        raise ValueError(f"{name} has dtype {stored}; supported: {sorted(_SAFETENSORS_DTYPES)}.")
    return _SAFETENSORS_DTYPES[stored]


# ---------------------------------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------------------------------
class _ShardReader:
    """Reads checkpoint tensors by name, keeping a single input shard mapped at a time."""

    def __init__(self, entries: dict[str, CheckpointEntry]):
        self.entries = entries
        self._path, self._shard = None, None

    def __call__(self, name: str) -> torch.Tensor:
        path = self.entries[name].path
        if path != self._path:
            self._shard = None  # unmap the previous shard before mapping the next
            self._shard, self._path = safe_open(path, framework="pt"), path
        return self._shard.get_tensor(name)


def checkpoint_shard_files(folder: Path) -> list[str]:
    """The safetensors shards of a saved folder: those its index names, or its single ``model.safetensors``."""
    index, single = folder / SAFETENSORS_INDEX_FILE, folder / SAFETENSORS_SINGLE_FILE
    if os.path.lexists(index):
        return shard_index_files(str(index), folder_root(folder))
    if os.path.lexists(single):
        return [checked_regular_file(single, folder_root(folder))]
    raise ValueError(f"{folder} holds no {SAFETENSORS_SINGLE_FILE} or {SAFETENSORS_INDEX_FILE}.")


def _open_checkpoint(folder: Path) -> tuple[dict[str, CheckpointEntry], _ShardReader]:
    entries = read_safetensors_headers(checkpoint_shard_files(folder))
    return entries, _ShardReader(entries)


def _write_checkpoint(steps: list[_Step], folder: Path, max_shard_bytes: int, progress: bool, desc: str) -> list[str]:
    """Write the steps' outputs in shards of at most ``max_shard_bytes`` (a step never straddles two shards), grouped and
    named by huggingface_hub's sharding (``model-00001-of-00002.safetensors``, as ``save_pretrained``), each step's
    tensors made only when its shard is written."""
    if max_shard_bytes < 1:
        raise ValueError(f"`max_shard_bytes` must be a positive number of bytes, got {max_shard_bytes}.")
    split = split_state_dict_into_shards_factory(
        {str(number): step for number, step in enumerate(steps)}, get_storage_size=lambda step: step.nbytes,
        filename_pattern=SAFETENSORS_WEIGHTS_FILE_PATTERN, max_shard_size=max_shard_bytes,
    )
    weight_map = {}
    with tqdm(total=split.metadata["total_size"], unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        for shard_name, step_numbers in split.filename_to_tensors.items():
            tensors = {}
            for number in step_numbers:
                tensors.update(steps[int(number)].make())
                bar.update(steps[int(number)].nbytes)
            save_file(tensors, str(folder / shard_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, shard_name))
            del tensors
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": weight_map}
        (folder / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(split.filename_to_tensors)


def _absent_or_empty(folder: Path) -> Path:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"The output folder {folder} is not empty; stale shards would mix with the new ones.")
    return folder


def _copy_auxiliary_files(source: Path, target: Path) -> None:
    """Tokenizer, generation config, card: everything but weights, configs and code (each layout has its own), and
    never a checkpoint's Trainer state (optimizer moments, pickles), which is named once instead."""
    left_out, root = [], folder_root(source)
    for path in sorted(source.iterdir()):
        skipped = path.name in ("config.json", SAFETENSORS_INDEX_FILE) or path.suffix in (".safetensors", ".py")
        if any(fnmatch(path.name, pattern) for pattern in run_folder.TRAINER_STATE_PATTERNS):
            left_out.append(path.name)
        elif not skipped and not path.is_dir():
            shutil.copy2(checked_regular_file(path, root), target / path.name)  # checked again: it may have changed
    if left_out:
        print(f"not converted (Trainer state, not part of the model): {', '.join(left_out)}", file=sys.stderr)
