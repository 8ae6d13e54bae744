"""Publish a saved model folder with the standard hub client: ``create_repo`` then ``upload_folder``.

Uploading the folder as it is keeps our README.md; ``model.push_to_hub`` would overwrite it with the hub's card or
the generic template (hf-integration.md §1.5).
"""

from pathlib import Path

from huggingface_hub import HfApi, get_token

from .model_card import is_our_card

# Trainer state a checkpoint folder holds besides the model; none of it belongs in a published model.
TRAINING_STATE_PATTERNS = ["optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth", "trainer_state.json",
                           "training_args.bin", "batch_size.json", ".*"]
REQUIRED_FILES = (
    "config.json", "checkpoint_format_kimi_k3.py", "configuration_kimi_k3.py", "modeling_kimi_k3.py", "tokenizer.json"
)


class HubError(ValueError):
    """A push that cannot succeed: no token, or a folder that is not a complete Kimi K3 model."""


def resolve_token(token: str | None = None) -> str:
    """The explicit token, else HF_TOKEN or the stored login; checked before training so a run never ends unpushed."""
    token = token or get_token()
    if not token:
        raise HubError(
            "pushing to the hub needs a token: pass --hub_token, set HF_TOKEN, or log in with `hf auth login`"
        )
    return token


def check_model_files(folder: Path) -> None:
    """Code, config, weights and tokenizer: what a reload with trust_remote_code and generation need."""
    if not folder.is_dir():
        raise HubError(f"{folder} is not a folder")
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise HubError(f"{folder} is not a complete Kimi K3 model folder; missing {missing}")


def check_publishable(folder: Path) -> None:
    """A published folder must reload with trust_remote_code and carry our card, not the generic one."""
    check_model_files(folder)
    if not is_our_card(folder / "README.md"):
        raise HubError(f"{folder}/README.md is missing or is not a Kimi K3 model card (no 'kimi_k3' tag)")


def push_folder(
    folder: str | Path,
    repo_id: str,
    api: HfApi,
    private: bool | None = None,
    commit_message: str = "Upload Kimi K3 model",
) -> str:
    """Create (or reuse) ``repo_id`` and upload the model files of ``folder``; returns the repo id."""
    folder = Path(folder)
    check_publishable(folder)
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(
        repo_id=repo.repo_id,
        folder_path=folder,
        commit_message=commit_message,
        ignore_patterns=TRAINING_STATE_PATTERNS,
    )
    return repo.repo_id
