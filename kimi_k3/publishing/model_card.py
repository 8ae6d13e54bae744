"""Our own model card (``README.md``) for a trained Kimi K3 folder.

``model.push_to_hub`` would replace README.md with the hub's card or the generic "Model Card for Model ID" template
so the card is rendered here from the package's ``templates/model_card.md`` and uploaded
with the folder.

Its YAML header follows the hub's rules for model metadata: a license identifier (or ``other`` with a name and a
link), ``base_model`` and ``datasets`` as hub ids only, ISO 639 language codes. The hub checks them only online
(``RepoCard.validate``); :func:`metadata_problems` applies the same rules offline, before anything is uploaded.
"""

import difflib
import os
import re
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

import torch
import jinja2
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.publishing.hub_licenses import HUB_LICENSE_IDS
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from variants_kimi_k3 import causal_lm_class

# Package data, so the template ships in the wheel and is found in any install, not only in a source checkout.
TEMPLATE_PATH = files("kimi_k3.publishing") / "templates" / "model_card.md"
# The card's last section, rendered on its own so that a published card can name its hub repository.
USAGE_TEMPLATE_PATH = files("kimi_k3.publishing") / "templates" / "model_card_usage.md"
USAGE_HEADING = "\n## Usage\n"
TAGS = ["custom_code", "kimi_k3", "moe"]
# The hub task of a text model and of one with the vision tower (KimiK3ForConditionalGeneration).
TEXT_PIPELINE, VISION_PIPELINE = "text-generation", "image-text-to-text"
# Columns of the per-layer load-balance table: metric key of balance_metrics.load_balance_metrics -> header.
BALANCE_COLUMNS = {
    "max_vio": "MaxVio",
    "cv": "CV",
    "min_over_mean": "min / mean",
    "dead_experts": "dead experts",
    "bias_range": "bias range",
}
# The released checkpoint. Its license is not stated in the report, so a derivative points at the
# release's own LICENSE file instead of naming terms (K2, for one, shipped a modified MIT licence as `other`).
K3_RELEASE = "moonshotai/Kimi-K3"
K3_RELEASE_LICENSE = {
    "license": "other",
    "license_name": "kimi-k3",
    "license_link": f"https://huggingface.co/{K3_RELEASE}/blob/main/LICENSE",
}
LICENSE_FIELDS = ("license", "license_name", "license_link")
# Custom license names are lower-case, as the hub's own identifiers (apache-2.0, cc-by-4.0, llama3.1, openrail++) are.
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")
LANGUAGE_CODE = re.compile(r"[a-z]{2,3}(-[A-Za-z0-9]{2,8})*")


@dataclass
class TrainingSummary:
    """What a run did and reached; every field is printed in the card."""

    data: str
    train_tokens: int
    eval_tokens: int
    block_size: int
    steps: int
    global_batch_size: int
    optimizer: str
    learning_rate: float
    router_balancing: str
    first_loss: float
    last_loss: float
    eval_loss: float
    eval_perplexity: float
    wall_time_s: float
    base_model: str | None = None
    # Optimizer steps at which the run was resumed, one per job after the first.
    resumed_at: list[int] = field(default_factory=list)
    qat: str = "none"
    weights_on_disk: str = "this project's layout"
    qk_clip: str = "off"
    # `kimi_k3.text.corpus.PACKING_MODES`: whether the blocks kept their document boundaries.
    packing: str = "documents"
    # What accelerate ran: how the processes shared the model, and the autocast of the forward and backward.
    parallelism: str = "one process"
    autocast: str = "none (fp32 compute)"


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Total and per-token active parameters (buffers such as the router bias are not parameters).

    Active = every parameter except the input embedding table (a row lookup, not a matmul) and the routed experts
    a token does not visit: of each MoE layer's E experts, k are used, so (E - k)/E of its expert weights are idle.
    Shared-basis experts build every used expert from all basis matrices: only the unused experts' coefficients idle.
    """
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    idle = 0
    if config.num_experts:
        unused = config.num_experts - config.num_experts_per_token
        coefficients = sum(p.numel() for name, p in model.named_parameters() if name.endswith("_coefficients"))
        basis = getattr(config, "expert_basis_size", None)
        idle = coefficients * unused // config.num_experts if basis else routed * unused // config.num_experts
    return {"total": total, "embedding": embedding, "routed_experts": routed, "active": total - embedding - idle}


def architecture_summary(config) -> dict[str, object]:
    """The config fields a reader needs to picture the model, in the released field names."""
    return {
        "layers": config.num_hidden_layers,
        "layer pattern": " ".join("MLA" if kind == "full_attention" else "KDA" for kind in config.layer_types),
        "MLP pattern": " ".join("MoE" if kind == "sparse" else "dense" for kind in config.mlp_layer_types),
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "KDA heads x head_dim": f"{config.linear_num_heads} x {config.linear_head_dim}",
        "MLA heads (nope + rope / v dims)": f"{config.num_attention_heads} "
        f"({config.qk_nope_head_dim} + {config.qk_rope_head_dim} / {config.v_head_dim})",
        "routed experts (top-k)": f"{config.num_experts} ({config.num_experts_per_token})",
        "shared experts": config.num_shared_experts,
        "expert latent size / intermediate": f"{config.routed_expert_hidden_size} / {config.moe_intermediate_size}",
        "AttnRes block size": config.attn_res_block_size,
        # Only for the opt-in variants (docs/variants.md): a released-style card has no such row.
        **({"Stable LatentMoE variants": ", ".join(config.enabled_variants)} if getattr(config, "enabled_variants", ())
           else {}),
    }


def card_metadata(
    base_model: str | None = None,
    license: str | None = None,
    license_name: str | None = None,
    license_link: str | None = None,
    language: list[str] | None = None,
    datasets: list[str] | None = None,
) -> dict[str, object]:
    """The card's hub metadata besides library, pipeline and tags; a ValueError names the flag that is wrong.

    License: ``license`` when given (``other`` with a name and a link). Otherwise a fine-tuned model keeps the license
    of its base, read from the base folder's card, or the K3 release's for a base on the hub under
    ``moonshotai/Kimi-K3``: weights derived from licensed weights stay under that license. A model trained from
    scratch declares none: its weights are its trainer's work on data they chose, no upstream terms bind them, and
    choosing a license is the owner's legal decision, not one a tool should make for them.

    ``base_model`` is listed only when it is a hub id; a local folder appears in the card's prose alone. ``datasets``
    are hub ids of the data the model was trained on, ``language`` ISO 639 codes.
    """
    metadata: dict[str, object] = license_metadata(license, license_name, license_link) or inherited_license(base_model)
    if hub_repo_id(base_model):
        metadata["base_model"] = base_model
    for code in language or []:
        if not LANGUAGE_CODE.fullmatch(code):
            raise ValueError(f"--language {code!r} is not an ISO 639 language code (e.g. en, fr, zh)")
    for dataset in datasets or []:
        if not is_repo_id(dataset):
            raise ValueError(f"--dataset_ids {dataset!r} is not a hub dataset id (name or namespace/name)")
    if language:
        metadata["language"] = list(language)
    if datasets:
        metadata["datasets"] = list(datasets)
    return metadata


def license_metadata(license: str | None, name: str | None = None, link: str | None = None) -> dict[str, str]:
    """The license fields of ``--license`` / ``--license_name`` / ``--license_link``; empty when none is given."""
    if license is None:
        if name or link:
            raise ValueError("--license_name and --license_link describe a custom license: add --license other")
        return {}
    fields = {"license": license}
    if license == "other":
        if not (name and link):
            raise ValueError("--license other needs --license_name NAME and --license_link URL (the hub shows both)")
        if not link.startswith(("https://", "http://")):
            raise ValueError(f"--license_link must be a URL (the model folder holds no license file), got {link!r}")
        fields |= {"license_name": name, "license_link": link}
    elif name or link:
        raise ValueError(f"--license_name and --license_link go with --license other; {license!r} needs neither")
    problems = license_problems(fields)
    if problems:
        raise ValueError(f"--license: {'; '.join(problems)}")
    return fields


def inherited_license(base_model: str | None) -> dict[str, str]:
    """The license fields of the base model's card (a local folder), or the release's for a K3 release id."""
    if base_model is None:
        return {}
    if Path(base_model).exists():
        readme = Path(base_model) / "README.md"
        if not readme.is_file():
            return {}
        data = ModelCard.load(readme).data.to_dict()
        fields = {key: data[key] for key in LICENSE_FIELDS if data.get(key)}
        # A relative link names a file of the base folder, which the new folder does not hold.
        relative_link = not str(fields.get("license_link", "https://")).startswith(("https://", "http://"))
        return {} if "license" not in fields or relative_link or license_problems(fields) else fields
    if base_model.lower() == K3_RELEASE.lower() or base_model.lower().startswith(f"{K3_RELEASE.lower()}-"):
        return dict(K3_RELEASE_LICENSE)
    return {}


def public_name(source: str) -> str:
    """How a card names a model or data source: a hub id as it is, a local path by its last component only (the
    card must not publish the layout of the trainer's disk)."""
    return source if hub_repo_id(source) else Path(source).name


def hub_repo_id(name: str | None) -> str | None:
    """``name`` when it names a hub repository; None for a local folder, which wins when both could be meant."""
    if name is None or Path(name).exists() or not is_repo_id(name):
        return None
    return name


def is_repo_id(name: object) -> bool:
    try:
        validate_repo_id(name)
    except (HFValidationError, TypeError):
        return False
    return isinstance(name, str)


def license_problems(data: dict) -> list[str]:
    license = data.get("license")
    if license is None:
        extra = [key for key in LICENSE_FIELDS[1:] if data.get(key)]
        return [f"{' and '.join(extra)} without license: other"] if extra else []
    problems = []
    if license not in HUB_LICENSE_IDS:
        problems.append(f"license {license!r} is not a hub license identifier{closest_license_hint(license)}")
    if license == "other":
        name, link = data.get("license_name"), data.get("license_link")
        if not (isinstance(name, str) and LICENSE_ID.fullmatch(name)):
            problems.append(f"license: other needs a lower-case license_name, got {name!r}")
        if not (isinstance(link, str) and link.strip()):
            problems.append(f"license: other needs a license_link, got {link!r}")
    return problems


def closest_license_hint(license) -> str:
    """``; did you mean 'apache-2.0'?`` for ``apache2``, else where the hub lists its identifiers."""
    close = difflib.get_close_matches(str(license).lower(), sorted(HUB_LICENSE_IDS), n=1, cutoff=0.75)
    if close:
        return f"; did you mean {close[0]!r}?"
    return " (https://huggingface.co/docs/hub/repositories-licenses lists them; or use other with a name and a link)"


def metadata_problems(data: dict) -> list[str]:
    """What the hub's model-card metadata rules reject in ``data`` (a card's YAML header as a dict); empty if valid."""
    problems = license_problems(data)
    if data.get("library_name") != "transformers":
        problems.append(f"library_name must be transformers, got {data.get('library_name')!r}")
    if data.get("pipeline_tag") not in (TEXT_PIPELINE, VISION_PIPELINE):
        problems.append(
            f"pipeline_tag must be {TEXT_PIPELINE} or {VISION_PIPELINE}, got {data.get('pipeline_tag')!r}"
        )
    for key, valid, what in (
        ("base_model", is_repo_id, "a hub model id"),
        ("datasets", is_repo_id, "a hub dataset id"),
        ("language", lambda code: isinstance(code, str) and LANGUAGE_CODE.fullmatch(code), "an ISO 639 code"),
        ("tags", lambda tag: isinstance(tag, str) and tag.strip(), "a non-empty string"),
    ):
        values = data.get(key)
        for value in [values] if isinstance(values, str) else values or []:
            if not valid(value):
                problems.append(f"{key} entry {value!r} is not {what}")
    return problems


def render_model_card(
    model: torch.nn.Module,
    name: str,
    summary: TrainingSummary | None = None,
    layer_balance: dict[str, dict[str, float]] | None = None,
    metadata: dict[str, object] | None = None,
    expert_load_image: str | None = None,
    template_path: str | os.PathLike | Traversable = TEMPLATE_PATH,
    local_folder: str | None = None,
) -> ModelCard:
    """The card of ``model`` published as ``name``; training sections are omitted when ``summary`` is None.

    ``metadata`` are the hub fields of :func:`card_metadata`; ``expert_load_image`` is the path, relative to the
    card, of the expert-load picture to embed (relative, so that it renders on the hub as well as locally). The
    usage snippet loads ``name`` from the hub, or ``local_folder`` (the saved folder's path) when one is given.
    The template is read here rather than by ``ModelCard.from_template`` because package data need not be a file on
    disk (e.g. a zipped install).
    """
    if isinstance(template_path, (str, os.PathLike)):
        template_path = Path(template_path)
    metadata = metadata or {}
    pipeline = pipeline_of(model.config)
    card_data = ModelCardData(
        library_name="transformers", pipeline_tag=pipeline, tags=[*TAGS, pipeline], model_name=name, **metadata
    )
    summary = asdict(summary) if summary else None
    if summary and summary["base_model"]:
        summary["base_model"] = public_name(summary["base_model"])
    balance_rows = [
        {"layer": layer, **{key: metrics[key] for key in BALANCE_COLUMNS}}
        for layer, metrics in (layer_balance or {}).items()
        if metrics
    ]
    return ModelCard.from_template(
        card_data,
        template_str=template_path.read_text(encoding="utf-8"),
        name=name,
        config=model.config,
        architecture=architecture_summary(model.config),
        params=parameter_counts(model),
        summary=summary,
        balance_columns=BALANCE_COLUMNS,
        balance_rows=balance_rows,
        expert_load_image=expert_load_image,
        usage=usage_section(local_folder or name, local=local_folder is not None, pipeline=pipeline),
    )


def pipeline_of(config) -> str:
    """The hub task of a model with ``config``: image-text-to-text when it has the vision tower."""
    return VISION_PIPELINE if config.vision_config is not None else TEXT_PIPELINE


def usage_section(load_from: str, local: bool = False, pipeline: str = TEXT_PIPELINE) -> str:
    """The card's closing ``## Usage`` section, loading ``load_from`` (a hub id, or with ``local`` a folder path) with
    the Auto classes of ``pipeline``."""
    template = jinja2.Template(USAGE_TEMPLATE_PATH.read_text(encoding="utf-8"), keep_trailing_newline=True)
    return template.render(load_from=load_from, local=local, vision=pipeline == VISION_PIPELINE)


def name_card_for_repo(readme: Path, repo_id: str) -> None:
    """Make the card ``readme`` describe ``repo_id``: its model_name, title and usage snippet; the rest is kept."""
    card = ModelCard.load(readme)
    body, heading, _ = card.text.partition(USAGE_HEADING)
    if not heading:
        raise ValueError(f"{readme} has no '## Usage' section to point at {repo_id}")
    title = re.compile(r"^# .*$", re.MULTILINE)
    if not title.search(body):
        raise ValueError(f"{readme} has no '# ' title to name {repo_id}")
    card.data.model_name = repo_id
    usage = usage_section(repo_id, pipeline=card.data.pipeline_tag or TEXT_PIPELINE)
    card.text = title.sub(lambda _: f"# {repo_id}", body, count=1) + "\n" + usage
    card.save(readme)


def card_for_folder(folder: Path, name: str, metadata: dict[str, object] | None = None) -> ModelCard:
    """Card of a saved folder without training records (e.g. ``checkpoint-N``): architecture and parameters only."""
    with torch.device("meta"):  # parameter counts need shapes, not weights
        config = KimiK3Config.from_pretrained(folder)
        model_class = KimiK3ForConditionalGeneration if config.vision_config is not None else causal_lm_class(config)
        model = model_class(config)
    return render_model_card(model, name, metadata=metadata)


def card_to_publish(model: torch.nn.Module, repo_id: str) -> ModelCard:
    """The card to publish ``model`` as ``repo_id``: the Kimi K3 card of the local folder it was loaded from (named for
    ``repo_id``; title and usage stay), else one rendered for the model without training records."""
    folder_card = Path(str(getattr(model, "name_or_path", "") or ""), "README.md")
    if not is_our_card(folder_card):
        return render_model_card(model, repo_id)
    card = ModelCard.load(folder_card)
    card.data.model_name = repo_id
    return card


def set_license(readme: Path, fields: dict[str, str]) -> None:
    """Replace the license fields of the card ``readme`` in place (the prose never states the license)."""
    card = ModelCard.load(readme)
    for key in LICENSE_FIELDS:
        setattr(card.data, key, fields.get(key))
    card.save(readme)


def is_our_card(path: Path) -> bool:
    """Whether ``path`` is a README.md rendered by :func:`render_model_card` (not a generic template card)."""
    if not path.is_file():
        return False
    return "kimi_k3" in (ModelCard.load(path).data.tags or [])
