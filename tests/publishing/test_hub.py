"""Publishing through the standard hub client, against a local stand-in for the hub: what is uploaded (to which
branch or pull request), that the card is ours, and that the uploaded folder reloads with trust_remote_code and
generates what the local folder does; that network and token failures end in one line naming the fix; and that a
wheel install, without the source tree, still renders the card."""

import contextlib
import http.server
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import zipfile
from functools import partial
from pathlib import Path

import huggingface_hub
import pytest
import transformers
from huggingface_hub import CommitInfo, HfApi, ModelCard, RepoUrl
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.utils import filter_repo_objects

from kimi_k3.publishing import hub
from kimi_k3.publishing.model_card import is_our_card, metadata_problems
from kimi_k3.publishing.push import main as push_main
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import HANG_CEILING_S, tiny_config
from kimi_k3.job.expert_load import matplotlib_available
from tests.conftest import TINY_CONFIG
from tests.job.test_train import generate_in_fresh_process, run_main, sampled_continuation, tiny_args, write_corpus
from variants_kimi_k3 import KimiK3VariantForCausalLM

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "someone/kimi-k3-tiny"
MODEL_FILES = {
    "README.md", "checkpoint_format_kimi_k3.py", "config.json", "configuration_kimi_k3.py",
    "configuration_kimi_k3_vision.py", "generation_config.json", "kda_kimi_k3.py", "loading_kimi_k3.py",
    "model.safetensors", "modeling_kimi_k3.py", "packing_kimi_k3.py", "tokenizer.json", "tokenizer_config.json",
}  # fmt: skip
# The training job's model/ folder also holds the card's picture (a checkpoint-N folder does not).
TRAINED_MODEL_FILES = MODEL_FILES | ({"expert_load.png"} if matplotlib_available() else set())

# Runs in `python -I`, which ignores PYTHONPATH and puts neither cwd nor the repository on sys.path: the unpacked wheel
# goes first on sys.path here, and the imported modules must come from it.
RENDER_CARD_FROM_WHEEL = """
import json, sys
from pathlib import Path
site, config = Path(sys.argv[1]), json.loads(sys.argv[2])
sys.path.insert(0, str(site))
import torch
import configuration_kimi_k3, modeling_kimi_k3
from kimi_k3.publishing import model_card
for module in (configuration_kimi_k3, modeling_kimi_k3, model_card):
    assert Path(module.__file__).is_relative_to(site), module.__file__
with torch.device("meta"):
    model = modeling_kimi_k3.KimiK3ForCausalLM(configuration_kimi_k3.KimiK3Config(**config))
print(model_card.render_model_card(model, "wheel-card").content)
"""


class FakeHfApi:
    """Stand-in for ``huggingface_hub.HfApi``: each repo is a folder under ``root`` (its main branch), another branch
    or a pull request is a folder ``repo@branch`` / ``repo@refs/pr/N``, each upload a recorded commit.

    Calls are checked against the real methods' signatures, so the code under test cannot drift from the client.
    Uploading to a branch that was never created fails the test (the hub answers 404).
    """

    endpoint = "https://huggingface.co"

    def __init__(self, root: Path):
        self.root = root
        self.calls: list[tuple[str, dict]] = []
        self.branches: set[tuple[str, str]] = set()
        self.pull_requests = 0

    def _record(self, name: str, *args, **kwargs) -> None:
        inspect.signature(getattr(HfApi, name)).bind(self, *args, **kwargs)
        self.calls.append((name, kwargs))

    def create_repo(self, repo_id, **kwargs):
        self._record("create_repo", repo_id, **kwargs)
        (self.root / repo_id).mkdir(parents=True, exist_ok=kwargs.get("exist_ok", False))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id, **kwargs):
        self._record("create_branch", repo_id, **kwargs)
        self.branches.add((repo_id, kwargs["branch"]))

    def whoami(self, **kwargs):
        self._record("whoami", **kwargs)
        return {"name": "someone"}

    def upload_folder(self, **kwargs):
        self._record("upload_folder", **kwargs)
        folder = Path(kwargs["folder_path"])
        files = [str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()]
        names = filter_repo_objects(files, allow_patterns=kwargs.get("allow_patterns"),
                                    ignore_patterns=kwargs.get("ignore_patterns"))
        return self._commit(kwargs["repo_id"], {name: folder / name for name in names}, kwargs)

    def create_commit(self, repo_id, operations, **kwargs):
        """What transformers' own ``push_to_hub`` calls, through its shared client."""
        self._record("create_commit", repo_id, operations, **kwargs)
        return self._commit(repo_id, {op.path_in_repo: op.path_or_fileobj for op in operations}, kwargs)

    def _commit(self, repo_id: str, files: dict, kwargs: dict) -> CommitInfo:
        """``files``: name -> a path, or an open binary file (read from where it is, as the hub client does)."""
        revision = kwargs.get("revision")
        if revision not in (None, "main") and (repo_id, revision) not in self.branches:
            raise AssertionError(f"upload to branch {revision} of {repo_id}, which was never created")
        pr_url = None
        if kwargs.get("create_pr"):
            self.pull_requests += 1
            revision, pr_url = f"refs/pr/{self.pull_requests}", f"{self.endpoint}/{repo_id}/discussions/{self.pull_requests}"
        remote = self.root / (repo_id if revision in (None, "main") else f"{repo_id}@{revision}")
        for name, source in files.items():
            target = remote / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(source, (str, Path)):
                shutil.copyfile(source, target)
            else:
                target.write_bytes(source.read())
        return CommitInfo(commit_url=f"{self.endpoint}/{repo_id}/commit/0", commit_message=kwargs.get("commit_message"),
                          commit_description="", oid="0" * 40, pr_url=pr_url)

    def load_card(self, repo_id: str, load, **kwargs) -> ModelCard:
        """``ModelCard.load`` of a stand-in repo: its README.md, or the hub's answer for a repo without one."""
        readme = self.root / repo_id / "README.md"
        if not readme.is_file():
            raise EntryNotFoundError(f"{repo_id} has no README.md")
        return load(readme, **kwargs)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch) -> FakeHfApi:
    api = FakeHfApi(tmp_path / "hub")
    monkeypatch.setattr(hub, "HfApi", lambda token: api)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # conftest sets HF_HUB_OFFLINE=1
    return api


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """A 2-step run with ``--push_to_hub``: (local run folder, remote repo folder, fake hub)."""
    root = tmp_path_factory.mktemp("push")
    api = FakeHfApi(root / "hub")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hub, "HfApi", lambda token: api)
        patch.setenv("HF_TOKEN", "hf_test_token")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # conftest sets HF_HUB_OFFLINE=1
        args = tiny_args(root / "run", write_corpus(root), "--max_steps", "2", "--save_steps", "1")
        status, printed = run_main([*args, "--eval_strategy", "no", "--push_to_hub", "--hub_model_id", REPO_ID])
    assert status == 0 and f"pushed {root / 'run' / 'model'} to {REPO_ID}" in printed
    return root / "run", api.root / REPO_ID, api


@pytest.fixture
def transformers_hub(fake_hub, monkeypatch) -> FakeHfApi:
    """The stand-in hub, also answering ``ModelCard.load`` for its repos."""
    load = ModelCard.load.__func__

    def load_card(cls, repo_id_or_path, **kwargs):
        if Path(repo_id_or_path).exists():
            return load(cls, repo_id_or_path, **kwargs)
        return fake_hub.load_card(str(repo_id_or_path), partial(load, cls), **kwargs)

    monkeypatch.setattr(ModelCard, "load", classmethod(load_card))
    return fake_hub


def test_push_model_uploads_a_kimi_k3_card_the_hub_accepts(transformers_hub, tmp_path):
    model = KimiK3ForCausalLM(tiny_config())
    assert hub.push_model(model, REPO_ID) == REPO_ID
    remote = transformers_hub.root / REPO_ID
    assert {"config.json", "model.safetensors", "modeling_kimi_k3.py", "README.md"} <= {p.name for p in remote.iterdir()}
    card = ModelCard.load(remote / "README.md")
    assert is_our_card(remote / "README.md") and metadata_problems(card.data.to_dict()) == []
    assert card.data.pipeline_tag == "text-generation" and "custom_code" in card.data.tags
    assert f'from_pretrained("{REPO_ID}", trust_remote_code=True)' in card.text


def test_push_model_of_a_trained_folder_uploads_its_card_and_keeps_a_card_the_repo_has(pushed, transformers_hub):
    run, _, _ = pushed
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "model", trust_remote_code=True)
    hub.push_model(model, "someone/again")
    card = ModelCard.load(transformers_hub.root / "someone" / "again" / "README.md")
    assert card.data.model_name == "someone/again" and "## Expert load balance" in card.text
    assert card.text == ModelCard.load(run / "model" / "README.md").text

    (transformers_hub.root / "someone" / "again" / "README.md").write_text("---\nlicense: mit\n---\n# Mine\n")
    hub.push_model(model, "someone/again")
    assert ModelCard.load(transformers_hub.root / "someone" / "again" / "README.md").text.strip() == "# Mine"


def test_push_uploads_code_config_weights_tokenizer_and_our_card(pushed):
    run, remote, api = pushed
    assert [name for name, _ in api.calls] == ["whoami", "create_repo", "create_commit"]  # the token before training
    assert {path.name for path in remote.iterdir()} == TRAINED_MODEL_FILES
    assert (remote / "README.md").read_bytes() == (run / "model" / "README.md").read_bytes()
    card = ModelCard.load(remote / "README.md")
    assert card.data.model_name == REPO_ID and {"custom_code", "kimi_k3", "moe"} <= set(card.data.tags)
    assert "Model Card for Model ID" not in card.text and "## Expert load balance" in card.text


def test_pushed_folder_reloads_with_remote_code_and_generates_same_tokens(pushed, tmp_path):
    run, remote, _ = pushed
    assert generate_in_fresh_process(remote, tmp_path) == sampled_continuation(run / "model")


def test_push_script_publishes_checkpoint_with_new_card_and_without_trainer_state(pushed, fake_hub, tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(pushed[0] / "checkpoint-2", checkpoint)
    assert {"optimizer.pt", "rng_state.pth", "trainer_state.json"} <= {path.name for path in checkpoint.iterdir()}

    assert push_main([str(checkpoint), "--hub_model_id", "someone/checkpoint", "--hub_private_repo"]) == 0
    remote = fake_hub.root / "someone" / "checkpoint"
    assert {path.name for path in remote.iterdir()} == MODEL_FILES
    assert fake_hub.calls[0] == ("create_repo", {"private": True, "exist_ok": True})
    card = ModelCard.load(remote / "README.md")
    assert "kimi_k3" in card.data.tags and "| total |" in card.text and "## Training" not in card.text


def test_push_script_refuses_a_config_json_the_config_refuses_in_one_line(pushed, fake_hub, tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(pushed[0] / "checkpoint-2", checkpoint)
    saved = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**saved, "rms_norm_eps": "1e-6"}))
    assert push_main([str(checkpoint), "--hub_model_id", REPO_ID]) == 2
    assert capsys.readouterr().err == (f"kimi-k3-push: error: {checkpoint}/config.json: Field 'rms_norm_eps' expected "
                                       "float, got str (value: '1e-6')\n")
    assert fake_hub.calls == []


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda folder: (folder / "modeling_kimi_k3.py").unlink(), "missing ['modeling_kimi_k3.py']"),
        (lambda folder: (folder / "README.md").write_text("# Model Card for Model ID\n"), "not a Kimi K3 model card"),
    ],
    ids=["incomplete folder", "generic card"],
)
def test_push_refuses_unpublishable_folder_before_creating_the_repo(pushed, fake_hub, tmp_path, spoil, message):
    folder = tmp_path / "model"
    shutil.copytree(pushed[0] / "model", folder)
    spoil(folder)
    with pytest.raises(hub.HubError, match=re.escape(message)):
        hub.push_folder(folder, REPO_ID, fake_hub)
    assert fake_hub.calls == []


def test_a_variant_folder_needs_the_variants_file_its_auto_map_names(tmp_path):
    KimiK3VariantForCausalLM(tiny_config(expert_basis_size=3)).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    code = {"checkpoint_format_kimi_k3.py", "configuration_kimi_k3.py", "kda_kimi_k3.py", "loading_kimi_k3.py",
            "modeling_kimi_k3.py", "packing_kimi_k3.py", "variants_kimi_k3.py"}
    assert code <= set(hub.remote_code_files(tmp_path)) == {path.name for path in tmp_path.glob("*.py")}
    hub.check_model_files(tmp_path)
    (tmp_path / "variants_kimi_k3.py").unlink()
    with pytest.raises(hub.HubError, match=re.escape("missing ['variants_kimi_k3.py']")):
        hub.check_model_files(tmp_path)


def test_push_script_without_token_exits_nonzero_naming_offline_mode_first_and_writes_nothing(
    pushed, tmp_path, monkeypatch, capsys
):
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(pushed[0] / "checkpoint-2", checkpoint)
    before = sorted(path.name for path in checkpoint.iterdir())

    # No token would help while offline mode refuses every push, so that comes first.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert push_main([str(checkpoint), "--hub_model_id", REPO_ID]) == 2
    error = capsys.readouterr().err
    assert error == "kimi-k3-push: error: cannot push while HF_HUB_OFFLINE is set: unset it (or set HF_HUB_OFFLINE=0) and rerun\n"

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert push_main([str(checkpoint), "--hub_model_id", REPO_ID]) == 2
    error = capsys.readouterr().err
    assert "needs a token: pass --hub_token, set HF_TOKEN" in error
    assert sorted(path.name for path in checkpoint.iterdir()) == before


def test_push_script_publishes_the_card_under_the_repo_id_it_pushes_to(fake_hub, tmp_path):
    """A folder trained without --hub_model_id: its card named the output folder and loaded the local path."""
    args = tiny_args(tmp_path / "run", write_corpus(tmp_path), "--max_steps", "2", "--save_steps", "2")
    assert run_main([*args, "--eval_strategy", "no"])[0] == 0
    local = ModelCard.load(tmp_path / "run" / "model" / "README.md")
    assert local.data.model_name == "run" and 'from_pretrained("path/to/model"' in local.text

    assert push_main([str(tmp_path / "run" / "model"), "--hub_model_id", "someone/renamed"]) == 0
    card = ModelCard.load(fake_hub.root / "someone" / "renamed" / "README.md")
    assert card.data.model_name == "someone/renamed" and "\n# someone/renamed\n" in card.text
    assert card.text.count('from_pretrained("someone/renamed", trust_remote_code=True)') == 2
    assert "path/to/model" not in card.text and "# run" not in card.text
    assert "## Expert load balance" in card.text and "| optimizer steps | 2 at 4 sequences per step |" in card.text


def test_push_script_commits_to_a_new_branch_or_opens_a_pull_request(pushed, fake_hub, capsys):
    model, push = str(pushed[0] / "model"), push_main
    assert push([model, "--hub_model_id", REPO_ID, "--hub_revision", "lr-sweep"]) == 0
    assert fake_hub.calls[1] == ("create_branch", {"branch": "lr-sweep", "exist_ok": True})
    assert {path.name for path in (fake_hub.root / f"{REPO_ID}@lr-sweep").iterdir()} == TRAINED_MODEL_FILES
    assert not any((fake_hub.root / REPO_ID).iterdir())  # main untouched
    assert f"to {REPO_ID}, branch lr-sweep" in capsys.readouterr().out

    assert push([model, "--hub_model_id", REPO_ID, "--create_pr"]) == 0
    assert push([model, "--hub_model_id", REPO_ID, "--hub_revision", "lr-sweep", "--create_pr"]) == 0
    uploads = [kwargs for name, kwargs in fake_hub.calls if name == "create_commit"]
    assert [(u["revision"], u["create_pr"]) for u in uploads] == [("lr-sweep", False), (None, True), ("lr-sweep", True)]
    assert {path.name for path in (fake_hub.root / f"{REPO_ID}@refs/pr/2").iterdir()} == TRAINED_MODEL_FILES
    assert not any((fake_hub.root / REPO_ID).iterdir())
    printed = capsys.readouterr().out
    assert f"to {REPO_ID}, pull request https://huggingface.co/{REPO_ID}/discussions/1" in printed
    assert f"to {REPO_ID}, branch lr-sweep, pull request https://huggingface.co/{REPO_ID}/discussions/2" in printed


def test_push_script_sets_the_card_license_and_refuses_an_incomplete_custom_one(pushed, fake_hub, tmp_path, capsys):
    folder = shutil.copytree(pushed[0] / "model", tmp_path / "model")
    push = push_main
    assert push([str(folder), "--hub_model_id", REPO_ID, "--license", "other", "--license_name", "acme-1.0"]) == 2
    assert "--license other needs --license_name NAME and --license_link URL" in capsys.readouterr().err
    assert fake_hub.calls == [] and ModelCard.load(folder / "README.md").data.license is None

    link = "https://example.com/acme-1.0.txt"
    assert push([str(folder), "--hub_model_id", REPO_ID, "--license", "other", "--license_name", "acme-1.0",
                 "--license_link", link]) == 0  # fmt: skip
    data = ModelCard.load(fake_hub.root / REPO_ID / "README.md").data
    assert (data.license, data.license_name, data.license_link) == ("other", "acme-1.0", link)
    assert push([str(folder), "--hub_model_id", REPO_ID, "--license", "mit"]) == 0
    data = ModelCard.load(fake_hub.root / REPO_ID / "README.md").data
    assert (data.license, data.license_name, data.license_link) == ("mit", None, None)


@contextlib.contextmanager
def stand_in_hub(case: str):
    """The endpoint a push meets: a closed port, or a local server answering every request with an HTTP status, or
    never within the test ("timeout")."""
    if case in ("connection refused", "offline"):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        yield f"http://127.0.0.1:{port}"  # nothing listens there any more
        return
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if case == "timeout":
                release.wait(10)
                return
            status = int(case.split()[0])
            body = json.dumps({"error": http.HTTPStatus(status).phrase}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()


PUSH_FAILURES = {
    "connection refused": ["cannot reach the hub at http://127.0.0.1:", "Connection refused", "check the network"],
    "timeout": ["did not answer within 0.5 s", "allow more with --timeout"],
    "401 unauthorized": ["rejected the token (401 Unauthorized)", "pass a valid one with --hub_token", "hf auth login"],
    "403 forbidden": [f"may not write to {REPO_ID} (403 Forbidden)", "with --hub_token", "with --hub_model_id"],
    "offline": ["HF_HUB_OFFLINE is set: unset it"],
}


@pytest.mark.parametrize("case", PUSH_FAILURES)
def test_push_failure_is_one_line_naming_cause_and_the_option_to_change(case, pushed, monkeypatch, capsys):
    """The real client against a stand-in endpoint: no traceback, one line, exit status 2."""
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", case == "offline")
    with stand_in_hub(case) as endpoint:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        status = push_main([str(pushed[0] / "model"), "--hub_model_id", REPO_ID, "--timeout", "0.5"])
    error = capsys.readouterr().err
    assert status == 2 and len(error.strip().splitlines()) == 1, error
    assert error.startswith("kimi-k3-push: error: ") and all(part in error for part in PUSH_FAILURES[case]), error


@pytest.mark.parametrize("case", ["401 unauthorized", "offline"])
def test_job_checks_the_push_token_with_the_hub_before_training(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_rejected")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", case == "offline")
    with stand_in_hub(case) as endpoint:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        args = tiny_args(tmp_path / "run", write_corpus(tmp_path), "--hub_model_id", REPO_ID)
        status, printed = run_main(args)
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and printed == "" and len(error) == 1
    assert error[0].startswith("kimi-k3-train: error: ") and PUSH_FAILURES[case][0] in error[0]
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_wheel_ships_card_template_and_renders_card_outside_source_tree(tmp_path):
    source = tmp_path / "source"  # a copy, so the build leaves no build/ or egg-info behind in the repository
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "outputs", "runs"
    ))  # fmt: skip
    build = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    built = subprocess.run(build, cwd=source, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("kimi_k3-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "kimi_k3/publishing/templates/model_card.md" in archive.namelist()
        archive.extractall(tmp_path / "site")

    shutil.rmtree(source)  # only the wheel's files remain to import from
    result = subprocess.run(
        [sys.executable, "-I", "-c", RENDER_CARD_FROM_WHEEL, str(tmp_path / "site"), json.dumps(TINY_CONFIG)],
        cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=HANG_CEILING_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    card = ModelCard(result.stdout)
    assert card.data.model_name == "wheel-card" and "kimi_k3" in card.data.tags
    assert "# wheel-card" in card.text and "| total |" in card.text and "## Training" not in card.text


def test_failed_push_leaves_the_local_card_as_it_was(pushed, fake_hub, tmp_path, monkeypatch, capsys):
    model = shutil.copytree(pushed[0] / "model", tmp_path / "model")
    checkpoint = shutil.copytree(pushed[0] / "checkpoint-2", tmp_path / "checkpoint-2")
    card = (model / "README.md").read_bytes()

    def refused(*args, **kwargs):
        raise hub.HubError("the hub refused the push (HTTP 500)")

    monkeypatch.setattr(hub, "push_folder", refused)
    assert push_main([str(model), "--hub_model_id", "someone/attempted"]) == 2
    assert push_main([str(checkpoint), "--hub_model_id", "someone/attempted"]) == 2
    assert (model / "README.md").read_bytes() == card
    assert not (checkpoint / "README.md").exists()
    assert capsys.readouterr().err.count("kimi-k3-push: error: the hub refused the push (HTTP 500)") == 2
