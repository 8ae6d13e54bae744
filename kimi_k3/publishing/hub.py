"""Publish a saved model folder with the standard hub client: ``create_repo``, ``create_branch``, then ``create_commit``
of the folder's files, each from a handle opened without following links (what is checked is what is uploaded).

Uploading the folder as it is keeps our README.md; ``model.push_to_hub`` would overwrite it with the hub's card or
the generic template. A push that fails on the network or on the token ends in one `HubError` whose message names the
cause and the fix, in the options both commands that push share (``kimi-k3-push`` and ``kimi-k3-train``, spelled as
``TrainingArguments`` spells them).
"""

import json
import os
import stat
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, constants, get_session, get_token
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.utils import filter_repo_objects
from transformers.dynamic_module_utils import get_relative_imports

from kimi_k3.checkpoint import run_folder
from kimi_k3.checkpoint.finite import check_finite_files
from kimi_k3.checkpoint.release_format import checkpoint_shard_files
from kimi_k3.publishing.model_card import card_to_publish, is_our_card, metadata_problems

# Trainer state and hidden files (staging folders, the job's lock) never belong in a published model.
TRAINING_STATE_PATTERNS = [*run_folder.TRAINER_STATE_PATTERNS, ".*"]
REQUIRED_FILES = (
    "config.json", "checkpoint_format_kimi_k3.py", "configuration_kimi_k3.py", "modeling_kimi_k3.py", "tokenizer.json"
)
# Pull-request refs take commits as they are; they cannot be created as branches.
PULL_REQUEST_REF = "refs/pr/"


TOKEN_OPTION, REPO_OPTION, TIMEOUT_OPTION = "--hub_token", "--hub_model_id", "--timeout"


class HubError(ValueError):
    """A push that cannot succeed or did not: no token, an incomplete folder, the hub unreachable or refusing."""


OFFLINE_MESSAGE = "cannot push while HF_HUB_OFFLINE is set: unset it (or set HF_HUB_OFFLINE=0) and rerun"


def check_online() -> None:
    """Offline mode refuses every push whatever the token, so it is named first."""
    if constants.HF_HUB_OFFLINE:
        raise HubError(OFFLINE_MESSAGE)


def resolve_token(token: str | None = None) -> str:
    """The explicit token, else HF_TOKEN or the stored login; checked before training so a run never ends unpushed."""
    token = token or get_token()
    if not token:
        raise HubError(
            f"pushing to the hub needs a token: pass {TOKEN_OPTION}, set HF_TOKEN, or log in with `hf auth login`"
        )
    return token


def check_token(token: str, repo_id: str, timeout: float | None = None) -> None:
    """Ask the hub whose ``token`` it is, so that a job refuses a rejected token (or an unreachable hub, or offline
    mode) before it trains rather than after."""
    check_online()
    api = HfApi(token=token)
    with failures_explained(api, repo_id, timeout):
        api.whoami()


def check_model_files(folder: Path) -> None:
    """Code, config, weights and tokenizer: what a reload with trust_remote_code and generation need."""
    if not folder.is_dir():
        raise HubError(f"{folder} is not a folder")
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    missing += [name for name in remote_code_files(folder) if name not in missing and not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise HubError(f"{folder} is not a complete Kimi K3 model folder; missing {missing}")


def remote_code_files(folder: Path) -> list[str]:
    """The files ``trust_remote_code`` fetches for ``folder``: each module its config's ``auto_map`` names (a variant
    model's file among them) and, recursively, what those import relatively."""
    config = folder / "config.json"
    auto_map = json.loads(config.read_text()).get("auto_map", {}) if config.is_file() else {}
    pending = [f"{reference.split('--')[-1].split('.')[0]}.py" for reference in auto_map.values()
               if isinstance(reference, str)]
    files = set()
    while pending:
        name = pending.pop()
        if name not in files:
            files.add(name)
            if (folder / name).is_file():
                pending += [f"{module}.py" for module in get_relative_imports(folder / name)]
    return sorted(files)


def published_files(folder: Path) -> list[str]:
    """The folder's files a push uploads (everything but Trainer state and hidden files), each refused in one line
    unless it is a regular file: a link would upload its target's contents (a token, another user's file) under the
    link's name, and a FIFO would block the upload."""
    entries = []
    for parent, folders, files in os.walk(folder):  # links to folders are listed, never entered
        linked_folders = [name for name in folders if Path(parent, name).is_symlink()]
        entries += [Path(parent, name).relative_to(folder).as_posix() for name in [*linked_folders, *files]]
    names = list(filter_repo_objects(entries, ignore_patterns=TRAINING_STATE_PATTERNS))
    for name in names:
        mode = (folder / name).lstat().st_mode
        if stat.S_ISLNK(mode):
            raise HubError(f"{folder / name} is a symbolic link; a push uploads regular files only: copy its target")
        if not stat.S_ISREG(mode):
            raise HubError(f"{folder / name} is not a regular file (a FIFO, device or socket); a push uploads files")
    return names


def open_published_file(folder: Path, name: str):
    """``folder / name`` opened for reading without following a link at any step below ``folder``, and refused in
    one line unless it is a regular file: a file swapped for a link after `published_files` checked it cannot make
    the upload read the link's target."""
    *parents, leaf = name.split("/")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO opens without waiting for a writer, then is refused
    descriptors = [os.open(folder, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for part in parents:
            descriptors.append(os.open(part, flags | os.O_DIRECTORY, dir_fd=descriptors[-1]))
        descriptor = os.open(leaf, flags, dir_fd=descriptors[-1])
    except OSError as error:  # ELOOP: a link where a file or folder was
        reason = os.strerror(error.errno)
        raise HubError(f"{folder / name} changed after it was checked ({reason}); push again") from None
    finally:
        for directory in descriptors:
            os.close(directory)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise HubError(f"{folder / name} changed after it was checked (no longer a regular file); push again")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def check_finite_weights(folder: Path) -> None:
    """A diverged model is never published."""
    try:
        check_finite_files(checkpoint_shard_files(folder), str(folder))
    except ValueError as error:
        raise HubError(str(error)) from None


def check_publishable(folder: Path) -> None:
    """A published folder must reload with trust_remote_code and carry our card, with metadata the hub accepts."""
    check_model_files(folder)
    check_finite_weights(folder)
    readme = folder / "README.md"
    if not is_our_card(readme):
        raise HubError(f"{readme} is missing or is not a Kimi K3 model card (no 'kimi_k3' tag)")
    problems = metadata_problems(ModelCard.load(readme).data.to_dict())
    if problems:
        raise HubError(f"{readme}: the hub would reject its metadata: {'; '.join(problems)}")


def push_folder(
    folder: str | Path,
    repo_id: str,
    api: HfApi,
    private: bool | None = None,
    commit_message: str = "Upload Kimi K3 model",
    revision: str | None = None,
    create_pr: bool = False,
    timeout: float | None = None,
) -> str:
    """Create (or reuse) ``repo_id`` and upload the model files of ``folder``; returns where they went.

    ``revision`` is the branch to commit to, created from the default branch if missing (a ``refs/pr/N`` ref adds
    to an open pull request); ``create_pr`` opens a pull request against it (or the default branch) instead of
    committing. ``timeout`` bounds connecting and each read or write of every request, in seconds.
    """
    folder = Path(folder)
    check_publishable(folder)
    with ExitStack() as opened, failures_explained(api, repo_id, timeout):
        # Checked and opened before the repository is created; the upload reads these handles, nothing else.
        files = {name: opened.enter_context(open_published_file(folder, name)) for name in published_files(folder)}
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None and not revision.startswith(PULL_REQUEST_REF):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=file) for name, file in files.items()]
        commit = api.create_commit(
            repo_id, operations, commit_message=commit_message, revision=revision, create_pr=create_pr
        )
    where = repo_id if revision is None else f"{repo_id}, branch {revision}"
    return f"{where}, pull request {commit.pr_url}" if create_pr else where


def push_model(model, repo_id: str, token: str | None = None, commit_message: str = "Upload Kimi K3 model") -> str:
    """Upload ``model`` as ``save_pretrained`` writes it (config, weights, model code) to ``repo_id`` with a Kimi K3
    card (`card_to_publish`) where the repository has none; returns the repository id. transformers' own
    ``model.push_to_hub`` uploads its generic template card instead; ``kimi-k3-push`` publishes a trained folder."""
    token = resolve_token(token)
    api = HfApi(token=token)
    with failures_explained(api, repo_id, None):
        repo_id = api.create_repo(repo_id, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            if not repository_has_card(repo_id, token):
                card_to_publish(model, repo_id).save(Path(folder, "README.md"))
            api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
    return repo_id


def repository_has_card(repo_id: str, token: str | None) -> bool:
    try:
        ModelCard.load(repo_id, token=token)
    except EntryNotFoundError:
        return False
    return True


@contextmanager
def failures_explained(api: HfApi, repo_id: str, timeout: float | None):
    """Turn the client's network, offline-mode and HTTP errors into one-line `HubError`s, within ``timeout``."""
    session = get_session()
    previous = session.timeout
    if timeout is not None:
        session.timeout = timeout
    try:
        yield
    except OfflineModeIsEnabled:
        raise HubError(OFFLINE_MESSAGE) from None
    except HfHubHTTPError as error:
        raise HubError(http_failure(error, repo_id)) from None
    except Exception as error:
        message = transport_failure(error, api.endpoint, timeout)
        if message is None:
            raise
        raise HubError(message) from None
    finally:
        session.timeout = previous


def http_failure(error: HfHubHTTPError, repo_id: str) -> str:
    status = error.response.status_code if error.response is not None else None
    if status == 401:
        return (
            f"the hub rejected the token (401 Unauthorized): pass a valid one with {TOKEN_OPTION}, set HF_TOKEN, or "
            "log in again with `hf auth login`"
        )
    if status == 403:
        return (
            f"the token may not write to {repo_id} (403 Forbidden): pass a token with write access to that namespace "
            f"with {TOKEN_OPTION}, or push to a repository of your own with {REPO_OPTION}"
        )
    detail = (error.server_message or str(error)).strip().splitlines()
    return f"the hub refused the push to {repo_id} (HTTP {status}): {detail[0] if detail else type(error).__name__}"


def transport_failure(error: Exception, endpoint: str, timeout: float | None) -> str | None:
    """The message for a connection that failed or timed out, else None (the command that set a ``timeout`` takes a
    longer one with ``--timeout``).

    Matched by class name: the client raises httpx's classes (huggingface_hub 1.x) or those of its fork httpx2 (2.x).
    """
    kinds = {cls.__name__ for cls in type(error).__mro__}
    if "TimeoutException" in kinds:
        longer = f", or allow more with {TIMEOUT_OPTION}" if timeout is not None else ""
        within = f" within {timeout:g} s" if timeout is not None else ""
        return f"the hub at {endpoint} did not answer{within}: check the connection and rerun{longer}"
    if "TransportError" in kinds:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (
            f"cannot reach the hub at {endpoint} ({reason}): check the network connection, and HF_ENDPOINT or the "
            "proxy settings if you set them, then rerun"
        )
    return None
