"""`run_folder.replace_folder` publishes a finished folder over the old one without a moment where the target is
missing: Linux swaps the two in one step (renameat2's RENAME_EXCHANGE); elsewhere two renames, whose gap a killed
job's successor repairs."""

import errno
import os
from pathlib import Path

import pytest

from kimi_k3.checkpoint import run_folder


def folders(tmp_path: Path) -> tuple[Path, Path]:
    target, staged = tmp_path / "model", tmp_path / run_folder.staging_name("model", "tag")
    for folder, text in ((target, "old"), (staged, "new")):
        folder.mkdir()
        (folder / "weights").write_text(text)
    return staged, target


def test_the_target_is_never_missing_while_it_is_replaced(tmp_path, monkeypatch):
    staged, target = folders(tmp_path)
    seen = []
    rename, exchange = os.rename, run_folder.exchange_paths
    monkeypatch.setattr(os, "rename", lambda *args: (seen.append(target.exists()), rename(*args)))
    monkeypatch.setattr(run_folder, "exchange_paths", lambda *args: (seen.append(target.exists()), exchange(*args))[1])
    run_folder.replace_folder(staged, target)
    assert (target / "weights").read_text() == "new" and sorted(path.name for path in tmp_path.iterdir()) == ["model"]
    if not exchange(tmp_path, tmp_path):  # a swap of a folder with itself: whether this system can swap at all
        pytest.skip("this system or filesystem has no renameat2(RENAME_EXCHANGE); the two-rename path is tested below")
    assert seen == [True]  # one swap, no rename


def test_without_the_swap_two_renames_replace_the_folder_and_recovery_restores_a_killed_one(tmp_path, monkeypatch):
    staged, target = folders(tmp_path)
    monkeypatch.setattr(run_folder, "exchange_paths", lambda *args: False)
    run_folder.replace_folder(staged, target)
    assert (target / "weights").read_text() == "new" and sorted(path.name for path in tmp_path.iterdir()) == ["model"]
    os.rename(target, run_folder.replaced_name(target))  # killed between the two renames
    assert run_folder.recover_replacements(tmp_path) == ["model"]
    assert (target / "weights").read_text() == "new"


def test_a_failed_swap_is_an_oserror_naming_the_target(tmp_path):
    if not run_folder.exchange_paths(tmp_path, tmp_path):
        pytest.skip("this system or filesystem has no renameat2(RENAME_EXCHANGE)")
    with pytest.raises(OSError) as error:
        run_folder.exchange_paths(tmp_path / "absent", tmp_path / "also-absent")
    assert error.value.errno == errno.ENOENT and str(tmp_path / "also-absent") in str(error.value)
