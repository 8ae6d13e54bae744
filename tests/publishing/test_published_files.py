"""`kimi-k3-push` uploads exactly the folder's regular files (less Trainer state and hidden files): a symbolic link,
which would upload its target's contents under its own name, or a FIFO is refused in one line naming it, before the
repository is created."""

import os
import shutil
from pathlib import Path

import pytest

from kimi_k3.publishing import hub
from kimi_k3.publishing.push import main as push_main
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config
from tests.publishing.test_hub import REPO_ID, FakeHfApi, fake_hub  # noqa: F401 (the stand-in hub fixture)


@pytest.fixture
def folder(tmp_path) -> Path:
    folder = tmp_path / "model"
    KimiK3ForCausalLM(tiny_config()).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def uploaded(hub: FakeHfApi) -> set[str]:
    remote = hub.root / REPO_ID
    return {path.relative_to(remote).as_posix() for path in remote.rglob("*") if path.is_file()}


@pytest.mark.parametrize("link", ["notes.txt", "generation_config.json", "extra/notes.txt", "linked_folder"])
def test_a_symbolic_link_is_refused_naming_it_before_the_repository_is_created(folder, fake_hub, tmp_path, capsys,
                                                                               link):
    secret = tmp_path / "token"
    secret.write_text("hf_secret")
    (folder / link).parent.mkdir(exist_ok=True)
    (folder / link).unlink(missing_ok=True)
    (folder / link).symlink_to(tmp_path if link == "linked_folder" else secret)
    assert push_main([str(folder), "--hub_model_id", REPO_ID]) == 2
    error = capsys.readouterr().err
    assert f"{folder / link} is a symbolic link" in error and len(error.strip().splitlines()) == 1
    assert fake_hub.calls == []


def test_a_fifo_is_refused_naming_it(folder, fake_hub, capsys):
    os.mkfifo(folder / "pipe.txt")
    assert push_main([str(folder), "--hub_model_id", REPO_ID]) == 2
    assert f"{folder / 'pipe.txt'} is not a regular file" in capsys.readouterr().err
    assert fake_hub.calls == []


def test_push_uploads_exactly_the_regular_files_less_trainer_state_and_hidden_files(folder, fake_hub):
    (folder / "extra").mkdir()
    (folder / "extra" / "notes[1].txt").write_text("kept, brackets and all")
    (folder / "optimizer.pt").write_bytes(b"trainer state")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "link").symlink_to("/etc/hostname")  # hidden: never uploaded, so never refused
    assert push_main([str(folder), "--hub_model_id", REPO_ID]) == 0
    expected = {path.name for path in folder.iterdir() if path.is_file() and path.name != "optimizer.pt"}
    assert uploaded(fake_hub) == expected | {"extra/notes[1].txt"}


@pytest.mark.parametrize("swapped", ["config.json", "extra/notes.txt", "extra"])
def test_a_file_or_folder_swapped_for_a_link_after_the_check_is_refused_before_anything_is_uploaded(
    folder, fake_hub, tmp_path, monkeypatch, capsys, swapped
):
    """The upload reads handles opened without following links, so what was checked is what is sent."""
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("notes")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "notes.txt").write_text("hf_secret")
    checked = hub.published_files

    def checked_then_swapped(checked_folder):
        names = checked(checked_folder)
        target = folder / swapped
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
        target.symlink_to(secret if swapped == "extra" else secret / "notes.txt")
        return names

    monkeypatch.setattr(hub, "published_files", checked_then_swapped)
    assert push_main([str(folder), "--hub_model_id", REPO_ID]) == 2
    error = capsys.readouterr().err
    assert "changed after it was checked" in error and len(error.strip().splitlines()) == 1
    assert fake_hub.calls == []
