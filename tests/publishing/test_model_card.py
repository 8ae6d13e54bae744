"""Model-card metadata by the hub's rules, checked offline: the YAML header parses with huggingface_hub's own card
classes and round-trips through ``ModelCardData``; licenses, base models, datasets and languages take only the values
the hub accepts; a local base folder stays out of the metadata."""

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard, ModelCardData

from kimi_k3.publishing.model_card import (
    K3_RELEASE,
    K3_RELEASE_LICENSE,
    TrainingSummary,
    architecture_summary,
    card_metadata,
    metadata_problems,
    name_card_for_repo,
    parameter_counts,
    render_model_card,
)
from modeling_kimi_k3 import KimiK3ForCausalLM
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from tests.conftest import tiny_config
from tests.test_modeling_vision import tiny_vl_config
from variants_kimi_k3 import KimiK3VariantForCausalLM


def summary(base_model: str | None = None, **fields) -> TrainingSummary:
    return TrainingSummary(**{
        "data": "local files: corpus.txt", "train_tokens": 1024, "eval_tokens": 128, "block_size": 32, "steps": 2,
        "global_batch_size": 4, "optimizer": "AdamW", "learning_rate": 1e-2, "router_balancing": "quantile_balancing",
        "first_loss": 5.0, "last_loss": 4.0, "eval_loss": 4.0, "eval_perplexity": 54.6, "wall_time_s": 1.0,
        "base_model": base_model, **fields,
    })  # fmt: skip


def tiny_model() -> KimiK3ForCausalLM:
    with torch.device("meta"):
        return KimiK3ForCausalLM(tiny_config())


def rendered_metadata(metadata: dict, base_model: str | None = None) -> tuple[dict, str]:
    """(YAML header as the hub's parser reads it, card text) of a card rendered with ``metadata``."""
    with torch.device("meta"):
        model = KimiK3ForCausalLM(tiny_config())
    text = str(render_model_card(model, "someone/tiny", summary(base_model), metadata=metadata))
    card = ModelCard(text)
    header = yaml.safe_load(text.split("---")[1])
    assert card.data.to_dict() == header
    return header, card.text


@pytest.fixture
def local_base(tmp_path):
    """A local fine-tuning base whose card declares a custom license, as a K3 derivative's does."""
    with torch.device("meta"):
        model = KimiK3ForCausalLM(tiny_config())
    render_model_card(model, "base", metadata=dict(K3_RELEASE_LICENSE)).save(tmp_path / "README.md")
    return str(tmp_path)


METADATA_CASES = {
    "from scratch: no license": (lambda base: card_metadata(), {}),
    "explicit hub license, language and dataset": (
        lambda base: card_metadata(license="apache-2.0", language=["en"], datasets=["someone/python-docs"]),
        {"license": "apache-2.0", "language": ["en"], "datasets": ["someone/python-docs"]},
    ),
    "custom license": (
        lambda base: card_metadata(license="other", license_name="acme-1.0", license_link="https://example.com/acme"),
        {"license": "other", "license_name": "acme-1.0", "license_link": "https://example.com/acme"},
    ),
    "fine-tuned from the release on the hub": (
        lambda base: card_metadata(K3_RELEASE), {**K3_RELEASE_LICENSE, "base_model": K3_RELEASE}
    ),
    "fine-tuned from a local folder: its license, no base_model": (lambda base: card_metadata(base), K3_RELEASE_LICENSE),
    "fine-tuned with an explicit license": (
        lambda base: card_metadata(K3_RELEASE, license="mit"), {"license": "mit", "base_model": K3_RELEASE}
    ),
}


@pytest.mark.parametrize("case", METADATA_CASES)
def test_card_metadata_is_valid_for_the_hub_and_round_trips_through_model_card_data(case, local_base):
    make, expected = METADATA_CASES[case]
    metadata = make(local_base)
    assert metadata == expected
    header, _ = rendered_metadata(metadata)
    fixed = {"library_name": "transformers", "pipeline_tag": "text-generation", "model_name": "someone/tiny"}
    assert header == {**fixed, "tags": ["custom_code", "kimi_k3", "moe", "text-generation"], **expected}
    assert ModelCardData(**header).to_dict() == header
    assert metadata_problems(header) == []


def test_local_base_folder_appears_in_the_prose_only_by_its_last_path_component(local_base):
    header, text = rendered_metadata(card_metadata(local_base), base_model=local_base)
    assert "base_model" not in header and local_base not in yaml.safe_dump(header)
    assert f"| fine-tuned from | {Path(local_base).name} |" in text and local_base not in text


def test_hub_base_model_is_named_by_its_full_id():
    _, text = rendered_metadata(card_metadata(K3_RELEASE), base_model=K3_RELEASE)
    assert f"| fine-tuned from | {K3_RELEASE} |" in text


def test_card_states_qk_clip_qat_and_the_layout_of_the_weights_on_disk():
    plain = str(render_model_card(tiny_model(), "someone/tiny", summary()))
    assert "| QK-Clip | off |" in plain and "| quantization-aware training | none |" in plain
    assert "| weights on disk | this project's layout |" in plain
    qat = dataclasses.replace(
        summary(), qk_clip="tau = 100", qat="MXFP4 routed experts (activations: MXFP8)",
        weights_on_disk="released layout, MXFP4 routed experts",
    )  # fmt: skip
    text = str(render_model_card(tiny_model(), "someone/tiny", qat))
    assert "| QK-Clip | tau = 100 |" in text
    assert "| quantization-aware training | MXFP4 routed experts (activations: MXFP8) |" in text
    assert "| weights on disk | released layout, MXFP4 routed experts |" in text


@pytest.mark.parametrize("packing, row", [
    ("documents", "| packing | documents: each block keeps its document boundaries, and every document starts from a "
                  "fresh model state |"),
    ("concatenate", "| packing | concatenate: blocks run across document boundaries, each document seeing its "
                    "neighbours' context |"),
])
def test_card_states_how_the_blocks_were_packed(packing, row):
    assert row in str(render_model_card(tiny_model(), "someone/tiny", summary(packing=packing)))


def test_card_wall_time_counts_every_job_of_a_resumed_run():
    assert "| wall time | 137 s |" in str(render_model_card(tiny_model(), "t", summary(wall_time_s=137.2)))
    resumed = summary(wall_time_s=137.2, resumed_at=[31])
    assert "| wall time | 137 s, over 2 jobs (resumed at step 31) |" in str(render_model_card(tiny_model(), "t", resumed))


def test_usage_snippet_loads_the_hub_id_or_the_local_folder_and_renaming_points_it_at_the_repo(tmp_path):
    hub_card = str(render_model_card(tiny_model(), "someone/tiny", summary()))
    assert 'from_pretrained("someone/tiny", trust_remote_code=True)' in hub_card and "relative to" not in hub_card

    local = render_model_card(tiny_model(), "run", summary(), local_folder="outputs/run/model")
    assert 'AutoModelForCausalLM.from_pretrained("outputs/run/model", trust_remote_code=True)' in str(local)
    assert 'from_pretrained("run"' not in str(local) and "relative to where the job ran" in str(local)
    local.save(tmp_path / "README.md")
    name_card_for_repo(tmp_path / "README.md", "someone/renamed")
    renamed = ModelCard.load(tmp_path / "README.md")
    assert renamed.data.model_name == "someone/renamed" and "\n# someone/renamed\n" in renamed.text
    assert renamed.text.count('from_pretrained("someone/renamed", trust_remote_code=True)') == 2
    assert "outputs/run/model" not in renamed.text and "relative to" not in renamed.text
    assert "| first training loss | 5.000 |" in renamed.text  # the rest of the card is kept
    assert renamed.text == ModelCard(str(render_model_card(tiny_model(), "someone/renamed", summary()))).text


def test_a_vision_language_card_names_its_task_and_loads_with_the_image_classes_after_renaming(tmp_path):
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(tiny_vl_config())
    card = render_model_card(model, "run", summary(), local_folder="outputs/run/model")
    assert card.data.pipeline_tag == "image-text-to-text" and "image-text-to-text" in card.data.tags
    assert metadata_problems(card.data.to_dict()) == [] and "MoonViT3d vision tower" in card.text
    assert 'AutoModelForImageTextToText.from_pretrained("outputs/run/model"' in card.text
    card.save(tmp_path / "README.md")
    name_card_for_repo(tmp_path / "README.md", "someone/vl")
    renamed = ModelCard.load(tmp_path / "README.md")
    assert 'AutoProcessor.from_pretrained("someone/vl", trust_remote_code=True)' in renamed.text
    assert "AutoModelForCausalLM" not in renamed.text
    assert "pipeline_tag must be" in metadata_problems({**renamed.data.to_dict(), "pipeline_tag": "translation"})[0]


HUB_REJECTS = {
    "upper-case license": ({"license": "Apache-2.0"}, "not a hub license identifier"),
    "other without link": ({"license": "other", "license_name": "acme"}, "license: other needs a license_link"),
    "license name without other": ({"license_name": "acme"}, "license_name without license: other"),
    "local path as base model": ({"base_model": "/data/runs/model"}, "base_model entry '/data/runs/model'"),
    "dataset path": ({"datasets": ["data/2025/corpus.txt"]}, "datasets entry 'data/2025/corpus.txt'"),
    "language name": ({"language": ["english"]}, "language entry 'english' is not an ISO 639 code"),
    "other library": ({"library_name": "peft"}, "library_name must be transformers"),
}


@pytest.mark.parametrize("case", HUB_REJECTS)
def test_metadata_rules_reject_what_the_hub_rejects(case):
    change, message = HUB_REJECTS[case]
    header = {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": ["kimi_k3"], **change}
    assert any(message in problem for problem in metadata_problems(header))


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"license": "other", "license_name": "acme"}, "--license other needs --license_name NAME and --license_link"),
        ({"license": "other", "license_name": "acme", "license_link": "LICENSE"}, "--license_link must be a URL"),
        ({"license": "mit", "license_link": "https://example.com"}, "go with --license other; 'mit' needs neither"),
        ({"license_name": "acme"}, "add --license other"),
        ({"license": "MIT"}, "not a hub license identifier"),
        ({"language": ["English"]}, "--language 'English' is not an ISO 639 language code"),
        ({"datasets": ["./corpus.txt"]}, "--dataset_ids './corpus.txt' is not a hub dataset id"),
    ],
)
def test_card_flags_are_checked_with_a_message_naming_the_flag(arguments, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        card_metadata(**arguments)


def test_card_names_the_enabled_variants_and_counts_a_shared_basis_as_active():
    assert "Stable LatentMoE variants" not in architecture_summary(tiny_config())
    config = tiny_config(expert_basis_size=3, attention_gate_routing=True)
    model = KimiK3VariantForCausalLM(config)
    assert architecture_summary(config)["Stable LatentMoE variants"] == (
        "shared-basis experts (expert_basis_size), routing-modulated attention gates (attention_gate_routing)"
    )
    counts = parameter_counts(model)
    # Every used expert reads all 3 basis matrices; only the 6 unused experts' coefficient rows (2 x 3 each) idle.
    moe_layers = config.mlp_layer_types.count("sparse")
    assert counts["total"] - counts["embedding"] - counts["active"] == moe_layers * 6 * 2 * 3
