"""The private and internal transformers / torch API this project relies on, each with why and a check.

This table is the one list of such uses. Every entry is checked against the installed versions, so a release that
renames or drops one fails here, naming the API, instead of failing users. ``test_no_unlisted_private_api`` finds
new underscored names the project borrows from transformers' or torch's base classes, so the list stays complete.
Public replacements are used wherever they exist (e.g. the cache argument: see ``take_cache_argument``).
"""

import ctypes
import importlib
import inspect
import io
import pathlib
import sys
import tokenize
from typing import NamedTuple

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel, Trainer

import configuration_kimi_k3
import modeling_kimi_k3

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT_FILES = [
    *sorted(ROOT.glob("*_kimi_k3.py")),  # the model files shipped with every checkpoint
    *sorted((ROOT / "kimi_k3").rglob("*.py")),
    *sorted((ROOT / "scripts").glob("*.py")),
    *sorted((ROOT / "tests" / "dist_scripts").glob("*.py")),
]
TRANSFORMERS_SOURCE = "\n".join(
    path.read_text() for path in pathlib.Path(transformers.__file__).parent.rglob("*.py") if "models" not in path.parts
)


class BorrowedApi(NamedTuple):
    name: str
    why: str
    still_there: callable


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def accepts_positionally(function, *names: str) -> bool:
    """``function(*names)`` still works: its leading positional parameters are ``names`` and any others have defaults
    (torch 2.15 added keyword-only ``min``/``max`` to ``maybe_mark_dynamic``)."""
    signature = inspect.signature(function).parameters.values()
    leading = [p.name for p in signature if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][: len(names)]
    rest = [p for p in signature if p.name not in names]
    return leading == list(names) and all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                                         for p in rest)


def read_by_transformers(attribute: str) -> callable:
    """A model-class attribute counts as supported while transformers' own code still reads it."""
    return lambda: hasattr(PreTrainedModel, attribute) and TRANSFORMERS_SOURCE.count(attribute) > 1


def module_has(module: str, *names: str) -> callable:
    return lambda: all(hasattr(importlib.import_module(module), name) for name in names)


BORROWED_API = [
    # Loading hooks: no public hook lets a model check a checkpoint before reading it or add load-only key mappings.
    BorrowedApi(
        "PreTrainedModel._load_pretrained_model",
        "released-layout folders are matched tensor by tensor before any is read, then loaded through load-only "
        "conversions (language_model. prefix, MXFP4 experts, padded A_log)",
        lambda: parameters(PreTrainedModel._load_pretrained_model)[:5]
        == ["model", "state_dict", "checkpoint_files", "load_config", "expected_keys"],
    ),
    BorrowedApi(
        "PreTrainedModel._weight_conversions",
        "cleared after a released-layout load so save_pretrained writes the project layout, not the release's",
        lambda: 'getattr(model, "_weight_conversions", None)' in TRANSFORMERS_SOURCE,
    ),
    BorrowedApi(
        "transformers.conversion_mapping.register_checkpoint_conversion_mapping",
        "declares the released per-expert keys <-> fused expert tensors once, for loading and saving",
        lambda: "overwrite" in parameters(
            importlib.import_module("transformers.conversion_mapping").register_checkpoint_conversion_mapping
        ),
    ),
    BorrowedApi(
        "transformers.core_model_loading (WeightConverter, ConversionOps, Concatenate, MergeModulelist, PrefixChange)",
        "the conversion operations of the mappings above",
        module_has(
            "transformers.core_model_loading",
            "WeightConverter", "ConversionOps", "Concatenate", "MergeModulelist", "PrefixChange",
        ),
    ),
    # Model-definition interface: transformers' own models declare these; there is no public spelling.
    BorrowedApi("PreTrainedConfig._attn_implementation", "selects sdpa/eager MLA attention through the attention "
                "interface", lambda: isinstance(inspect.getattr_static(PreTrainedConfig, "_attn_implementation"),
                                                property)),
    BorrowedApi("PreTrainedConfig._post_init_done", "KimiK3Config checks an assignment against the other fields "
                "(its @strict validate_* methods) once the constructor is done, which this flag marks",
                lambda: PreTrainedConfig()._post_init_done is True
                and "_post_init_done" not in PreTrainedConfig().to_dict()),
    BorrowedApi("GenerationConfig._get_default_generation_params", "KimiK3Config tells a released wrapper's generation "
                "defaults, which PreTrainedConfig drops, from the keys it keeps and logs",
                lambda: callable(getattr(transformers.GenerationConfig, "_get_default_generation_params", None))),
    BorrowedApi("PreTrainedModel._init_weights", "K3's initialisation (KDA decay ranges, zero AttnRes queries)",
                lambda: parameters(PreTrainedModel._init_weights) == ["self", "module"]),
    *[
        BorrowedApi(f"PreTrainedModel.{attribute}", why, read_by_transformers(attribute))
        for attribute, why in {
            "_no_split_modules": "device_map keeps a decoder layer (AttnRes reads every block) on one device",
            "_skip_keys_device_placement": "accelerate must not move the hybrid cache between devices",
            "_supports_sdpa": "MLA runs through torch's scaled_dot_product_attention",
            "_supports_flash_attn": "MLA's value width differs from its key width; flash-attn is refused",
            "_keep_in_fp32_modules_strict": "decay parameters, convs and the router bias stay fp32",
            "_keep_in_fp32_modules": "weight-swapping quantizers (torchao, bitsandbytes) skip the AttnRes "
                                     "pseudo-queries, which compute as an fp32 product and sum, not a linear layer",
            "_keys_to_ignore_on_load_unexpected": "released folders also hold vision-tower and projector tensors; "
                                                  "strict loading leaves unread what a class names here",
            "_keys_to_ignore_on_load_missing": "strict loading lets a class initialise what it names here (a new "
                                               "task head), as transformers' loading does",
            "_can_record_outputs": "router logits, hidden states and MLA attention maps through output capturing",
            "_tied_weights_keys": "tie_word_embeddings ties lm_head to the input embedding",
            "_tp_plan": "tensor parallelism splits lm_head by vocabulary (the rest of the plan is the config's)",
        }.items()
    ],
    BorrowedApi(
        "transformers internal utilities (merge_with_config_defaults, capture_outputs, OutputRecorder, "
        "use_experts_implementation, initialization)",
        "the same decorators and init helpers transformers' own models use for config defaults, output capture "
        "and the grouped-experts backends",
        lambda: module_has("transformers.utils.generic", "merge_with_config_defaults")()
        and module_has("transformers.utils.output_capturing", "capture_outputs", "OutputRecorder")()
        and module_has("transformers.integrations", "use_experts_implementation")()
        and module_has("transformers.initialization", "copy_", "normal_", "zeros_")(),
    ),
    # generate's own validation steps: what the KDA state cannot decode is refused there, before any forward.
    BorrowedApi("GenerationMixin._validate_model_kwargs", "generate refuses packed prompts (cu_seq_lens, seq_idx, "
                "restarting position_ids without a mask)",
                lambda: parameters(GenerationMixin._validate_model_kwargs) == ["self", "model_kwargs"]
                and "self._validate_model_kwargs(" in inspect.getsource(GenerationMixin.generate)),
    BorrowedApi("GenerationMixin._validate_generation_mode", "generate refuses assisted decoding (the KDA state cannot "
                "be rolled back) and a cache for a model without MLA layers",
                lambda: parameters(GenerationMixin._validate_generation_mode)
                == ["self", "generation_mode", "generation_config", "generation_mode_kwargs"]
                and "self._validate_generation_mode(" in inspect.getsource(GenerationMixin.generate)),
    BorrowedApi("GenerationMixin._get_stopping_criteria", "generate stops at max_position_embeddings, where "
                "transformers' MaxLengthCriteria only warns and the next forward would refuse the sequence",
                lambda: parameters(GenerationMixin._get_stopping_criteria)[:2] == ["self", "generation_config"]
                and "self._get_stopping_criteria(" in inspect.getsource(GenerationMixin.generate)),
    # The vision-language model (modeling_kimi_k3_vision.py): its prefill grows each sequence by the image tokens.
    BorrowedApi("GenerationMixin._update_model_kwargs_for_generation", "the vision-language model's later decoding "
                "steps extend the merged attention mask (image tokens in place of their placeholders) that its "
                "prefill returns, not the prompt's",
                lambda: parameters(GenerationMixin._update_model_kwargs_for_generation)[:3]
                == ["self", "outputs", "model_kwargs"]
                and "self._update_model_kwargs_for_generation(" in inspect.getsource(GenerationMixin._sample)),
    BorrowedApi("GenerationMixin._expand_inputs_for_generation", "beams and num_return_sequences repeat each prompt's "
                "images with it: the patches of all images are packed along dim 0, which transformers' repeat along "
                "dim 0 would interleave",
                lambda: parameters(GenerationMixin._expand_inputs_for_generation)[:4]
                == ["self", "expand_size", "is_encoder_decoder", "input_ids"]
                and "self._expand_inputs_for_generation(" in inspect.getsource(GenerationMixin.generate)),
    # The opt-in variants (variants_kimi_k3.py) and the folders that ship them.
    BorrowedApi("transformers.integrations.moe._grouped_linear, and the experts' `_is_expert_parallel` and "
                "`is_transposed` that use_experts_implementation sets",
                "the sorted experts (kimi_k3.kernels.sorted_experts) run the grouped GEMMs of transformers' grouped_mm "
                "experts backend, with its torch-version fallback, between their own gathers, and leave expert "
                "parallelism's sentinel rows to the backend",
                lambda: parameters(importlib.import_module("transformers.integrations.moe")._grouped_linear)
                == ["input", "weight", "offs", "bias", "is_transposed"]
                and all(f"self.{name} = " in inspect.getsource(importlib.import_module(
                    "transformers.integrations.moe").use_experts_implementation)
                    for name in ("_is_expert_parallel", "is_transposed"))),
    BorrowedApi("from_pretrained sets `config.distributed_config` before building the model",
                "a variant refuses tensor and expert parallelism while the model is built, before any weight is read",
                lambda: "config.distributed_config = distributed_config" in TRANSFORMERS_SOURCE),
    BorrowedApi("transformers.dynamic_module_utils.get_relative_imports",
                "a pushed folder must hold every file its auto_map names and what those import, which "
                "trust_remote_code fetches too",
                module_has("transformers.dynamic_module_utils", "get_relative_imports")),
    # torch's state-dict hook: the released per-expert keys load into the fused expert tensors under plain
    # load_state_dict (Trainer resume), which has no public per-module hook with the same reach.
    BorrowedApi("torch.nn.Module._load_from_state_dict", "experts accept released per-expert keys",
                lambda: parameters(torch.nn.Module._load_from_state_dict)[1:] == [
                    "state_dict", "prefix", "local_metadata", "strict", "missing_keys", "unexpected_keys",
                    "error_msgs"]),
    # torch's cast hook: a module cast has no public per-tensor opt-out, and `.to(torch.bfloat16)` must not round the
    # router bias, KDA decay parameters, short convolutions and gated output norm.
    BorrowedApi("torch.nn.Module._apply", "16-bit casts keep the fp32 tensors fp32",
                lambda: parameters(torch.nn.Module._apply) == ["self", "fn", "recurse"]),
    # Trainer hooks: checkpoints are staged in a hidden folder and renamed into place (atomic saves), and load into
    # models sharded at load time. Trainer has no public hook around the writing of a checkpoint folder.
    BorrowedApi("Trainer._save_checkpoint", "atomic checkpoint folders",
                lambda: parameters(Trainer._save_checkpoint) == ["self", "model", "trial"]),
    BorrowedApi("Trainer._get_output_dir", "points checkpoint writing at the staging folder",
                lambda: parameters(Trainer._get_output_dir) == ["self", "trial"]),
    BorrowedApi("Trainer._load_from_checkpoint", "resumes models sharded at load time",
                lambda: parameters(Trainer._load_from_checkpoint)[:3] == ["self", "resume_from_checkpoint", "model"]),
    BorrowedApi("Trainer._get_grad_norm", "its gradient norm, computed before every optimizer step, is checked for "
                "divergence instead of a second norm over the gradients",
                lambda: parameters(Trainer._get_grad_norm) == ["self", "model", "grad_norm"]),
    BorrowedApi("Trainer._load_best_model", "the best checkpoint of a sharded model",
                lambda: parameters(Trainer._load_best_model) == ["self"]),
    BorrowedApi("Trainer._load_optimizer_and_scheduler", "a resumed optimizer.pt that cannot be loaded is refused in "
                "one line naming the file", lambda: parameters(Trainer._load_optimizer_and_scheduler) == ["self", "checkpoint"]),
    BorrowedApi("Trainer._load_rng_state", "a resumed RNG file that cannot be loaded is refused in one line naming it",
                lambda: parameters(Trainer._load_rng_state) == ["self", "checkpoint"]),
    BorrowedApi("transformers.trainer (OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME, TRAINER_STATE_NAME)",
                "the file names Trainer resumes from, which a resume checks are all there before training",
                module_has("transformers.trainer", "OPTIMIZER_NAME", "OPTIMIZER_NAME_BIN", "SCHEDULER_NAME",
                           "TRAINER_STATE_NAME")),
    BorrowedApi("transformers.trainer_pt_utils.safe_globals", "loads a resumed RNG state (numpy objects) the way "
                "Trainer does, to check it before training", module_has("transformers.trainer_pt_utils", "safe_globals")),
    # DTensor's strided shard: transformers lays out the experts under expert parallelism (and packed gate/up rows
    # under tensor parallelism) with it, and only torch's own method says which indices each rank then holds.
    BorrowedApi(
        "torch.distributed.tensor.placement_types._StridedShard / _StridedShardOffsetMode.ALL",
        "kimi_k3.parallel.shard_layout finds the rows every rank holds, so that Per-Head Muon orthogonalises whole experts "
        "where they lie",
        lambda: hasattr(importlib.import_module("torch.distributed.tensor.placement_types")._StridedShardOffsetMode,
                        "ALL")
        and "offset_mode" in parameters(
            importlib.import_module("torch.distributed.tensor.placement_types")._StridedShard.local_shard_size_and_offset
        ),
    ),
    BorrowedApi("DTensor.__create_chunk_list__",
                "each rank checks at the first split step that the shard it computed for itself is its own (the "
                "offsets distributed checkpointing reads)",
                lambda: hasattr(importlib.import_module("torch.distributed.tensor").DTensor, "__create_chunk_list__")),
    # transformers' kernel seams (tests only): transformers >= 5.25 routes a seam's tensors by device itself.
    BorrowedApi("transformers.integrations.hub_kernels._PACKAGE_SUPPORTED_DEVICES (transformers >= 5.25; tests only)",
                "tests/test_kernel_seams.py lets its stand-in fla take CPU tensors under the decorator's device routing",
                lambda: Version(transformers.__version__) < Version("5.25")
                or module_has("transformers.integrations.hub_kernels", "_PACKAGE_SUPPORTED_DEVICES")()),
    # torch's CPU instruction-set queries: no public API says whether bf16 matmuls are native.
    BorrowedApi("torch.cpu._is_avx512_bf16_supported / torch.cpu._is_amx_tile_supported",
                "bf16 Newton–Schulz only on CPUs with native bf16 (kimi_k3.optim.precision); a missing query means fp32",
                lambda: hasattr(torch.cpu, "_is_avx512_bf16_supported") and hasattr(torch.cpu, "_is_amx_tile_supported")),
    # inductor's cache switch: its key omits ATEN_CPU_CAPABILITY, so a restricted process must keep out of the cache.
    BorrowedApi("torch._inductor.config.patch(fx_graph_cache=False)",
                "kimi_k3.kernels.compiled.isa_safe_compile_caches: kernels compiled under ATEN_CPU_CAPABILITY=avx2 never "
                "reach (or come from) an unrestricted process's cache",
                lambda: hasattr(importlib.import_module("torch._inductor.config"), "fx_graph_cache")),
    # AOTAutograd compiles a backward lazily, at the first backward() (torch 2.13), where a failure cannot fall back.
    BorrowedApi("torch._functorch.config.patch(force_non_lazy_backward_lowering=True)",
                "kimi_k3.kernels.compiled.backward_compiled_with_forward: a differentiable kernel's backward is compiled "
                "in its forward call, so a backward that cannot be compiled falls back to the eager function there",
                lambda: hasattr(importlib.import_module("torch._functorch.config"), "force_non_lazy_backward_lowering")),
    # torch.compile marks dims dynamic per tensor only through dynamo's own functions (its dynamic-shapes docs).
    BorrowedApi("torch._dynamo.maybe_mark_dynamic",
                "kimi_k3.kernels.compiled.leading_dims_dynamic: the SiTU-GLU kernels compile once per model width, "
                "with the width a constant, for every row count",
                lambda: accepts_positionally(importlib.import_module("torch._dynamo").maybe_mark_dynamic, "t", "index")),
    # inductor keeps 16-bit intermediates in fp32 unless told to round them as eager does.
    BorrowedApi("torch.compile(options={'emulate_precision_casts': True})",
                "kimi_k3.optim.elementwise: Per-Head Muon's compiled passes round a bf16 parameter's momentum and "
                "update after every operation, as eager does, so the compiled and eager paths give the same bits",
                lambda: hasattr(importlib.import_module("torch._inductor.config"), "emulate_precision_casts")),
    # torch keeps no public query for an active dispatch mode, under which a compiled call disables dynamo for good.
    BorrowedApi("torch.utils._python_dispatch.is_in_torch_dispatch_mode",
                "kimi_k3.kernels.compiled.CompiledFunction runs the eager function under a TorchDispatchMode (FLOP "
                "counters, operator recorders): the mode sees its operators, and the compiled kernel stays compiled",
                lambda: "include_infra_modes" in parameters(
                    importlib.import_module("torch.utils._python_dispatch").is_in_torch_dispatch_mode)),
    # torch sets flush-to-zero on the calling thread only; its OpenMP workers are reached through libgomp's own entry.
    BorrowedApi("libgomp's GOMP_parallel (the OpenMP runtime's compiler ABI, called through ctypes)",
                "kimi_k3.kernels.subnormals runs torch.set_flush_denormal on every worker of ATen's OpenMP team, which "
                "torch's own call does not reach once the workers exist",
                lambda: "OpenMP" not in torch.__config__.parallel_info() or sys.platform != "linux"
                or hasattr(ctypes.CDLL(None), "GOMP_parallel")),
    # Benchmarks only: torch keeps no public way to see every ATen call of a backward pass, or the compiler's phases.
    BorrowedApi("torch.utils._python_dispatch.TorchDispatchMode",
                "benchmarks/step_profile.py records every matrix product of a training step, forward, backward and "
                "optimizer, with where each operand lies, to replay them as the step's floor",
                lambda: hasattr(importlib.import_module("torch.utils._python_dispatch"), "TorchDispatchMode")),
    BorrowedApi("torch._dynamo.utils.compile_times",
                "benchmarks/bench_compile.py reports where torch.compile spends its time (tracing, AOT autograd, "
                "inductor, the C++ compiler)",
                lambda: callable(getattr(importlib.import_module("torch._dynamo.utils"), "compile_times", None))),
]


@pytest.mark.parametrize("api", BORROWED_API, ids=lambda api: api.name)
def test_borrowed_api_is_still_there(api):
    assert api.still_there(), (
        f"transformers {transformers.__version__} / torch {torch.__version__} changed {api.name}, which this project "
        f"uses because {api.why}. Adapt the project, or find a public replacement."
    )


def borrowed_underscored_names(path: pathlib.Path) -> set[str]:
    """Single-underscore names in a file that transformers' or torch's base classes define."""
    bases = (PreTrainedModel, PreTrainedConfig, Trainer, GenerationMixin, torch.nn.Module, torch.optim.Optimizer)
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    names = {t.string for t in tokens if t.type == tokenize.NAME and t.string[:1] == "_" and t.string[:2] != "__"}
    return {name for name in names if any(hasattr(base, name) for base in bases)}


def test_no_unlisted_private_api():
    listed = " ".join(api.name for api in BORROWED_API)
    unlisted = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in PROJECT_FILES
        for name in borrowed_underscored_names(path)
        if name not in listed
    }
    assert not unlisted, f"private API used but not listed in BORROWED_API (with why): {sorted(unlisted)}"


def test_declared_transformers_range_is_the_one_the_model_files_check():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"transformers{configuration_kimi_k3.SUPPORTED_TRANSFORMERS}"' in pyproject
    assert configuration_kimi_k3.transformers_is_supported()
    assert not configuration_kimi_k3.transformers_is_supported("5.22.2")
    assert configuration_kimi_k3.transformers_is_supported("5.25.0")
    assert not configuration_kimi_k3.transformers_is_supported("5.26.0")


def test_cache_field_follows_the_running_transformers():
    renamed = "cache" in transformers.modeling_outputs.MoeModelOutputWithPast.__dataclass_fields__
    assert modeling_kimi_k3.CACHE_FIELD == ("cache" if renamed else "past_key_values")
