"""A folder anyone could write into cannot make a loader block, read without end, or read a file outside it: every
file `from_pretrained` and the converter open (config, shard index, the shards it names) is checked to be a regular
file inside the folder before it is opened, and a refusal is one line naming the file."""

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kimi_k3.checkpoint import convert
from loading_kimi_k3 import checked_regular_file
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
# Far above a refusal's cost on the slowest machine, far below forever: a regression fails instead of hanging.
HANG_CEILING_S = 600


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("saved")
    KimiK3ForCausalLM(tiny_config()).save_pretrained(folder)
    return folder


def sharded_copy(saved: Path, folder: Path, second_shard: str) -> Path:
    """``saved`` as two shards, the index naming ``second_shard`` for half the tensors (the real file is not written
    unless the name is ``model-2.safetensors``)."""
    shutil.copytree(saved, folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file({name: tensors[name] for name in first}, folder / "model-1.safetensors", metadata={"format": "pt"})
    save_file({name: tensors[name] for name in second}, folder / "model-2.safetensors", metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(first, "model-1.safetensors"), **dict.fromkeys(second, second_shard)}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


LOAD_BOTH_WAYS = textwrap.dedent("""
    import sys
    from transformers import AutoModelForCausalLM
    from modeling_kimi_k3 import KimiK3ForCausalLM
    for load in (KimiK3ForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        try:
            load(sys.argv[1], trust_remote_code=True)
            print("LOADED")
        except ValueError as error:
            print("REFUSED", str(error).replace("\\n", "<newline>"))
""")


def refusals_in_a_subprocess(folder: Path) -> list[str]:
    """Load directly and through the remote code, in a process with a memory ceiling and a time ceiling: a reader
    blocked on a FIFO or reading ``/dev/zero`` fails the test instead of hanging the suite or the machine."""

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_BOTH_WAYS, str(folder)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=HANG_CEILING_S, preexec_fn=limit_memory,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def test_fifo_and_dev_zero_shards_are_refused_naming_the_shard_directly_and_as_remote_code(saved, tmp_path):
    fifo_folder = sharded_copy(saved, tmp_path / "fifo", "pipe.safetensors")
    os.mkfifo(fifo_folder / "pipe.safetensors")
    zero_folder = sharded_copy(saved, tmp_path / "zero", "/dev/zero")
    for folder, shard in ((fifo_folder, "pipe.safetensors"), (zero_folder, "/dev/zero")):
        lines = refusals_in_a_subprocess(folder)
        assert len(lines) == 2, lines
        for line in lines:
            assert line.startswith("REFUSED") and shard in line and "<newline>" not in line, line


def test_links_and_dot_dot_out_of_the_folder_are_refused_naming_the_file(saved, tmp_path):
    outside = tmp_path / "outside.safetensors"
    save_file(load_file(saved / "model.safetensors"), outside)
    dot_dot = sharded_copy(saved, tmp_path / "dotdot", "../outside.safetensors")
    with pytest.raises(ValueError, match=r"outside\.safetensors resolves to .* outside .*dotdot"):
        KimiK3ForCausalLM.from_pretrained(dot_dot)
    linked = sharded_copy(saved, tmp_path / "linked", "model-2.safetensors")
    (linked / "model-2.safetensors").unlink()
    (linked / "model-2.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match=r"model-2\.safetensors resolves to .* outside"):
        KimiK3ForCausalLM.from_pretrained(linked)
    linked_config = tmp_path / "linked_config"
    shutil.copytree(saved, linked_config)
    (linked_config / "config.json").unlink()
    (linked_config / "config.json").symlink_to(saved / "config.json")
    with pytest.raises(ValueError, match=r"config\.json resolves to .* outside"):
        KimiK3ForCausalLM.from_pretrained(linked_config)


def test_links_inside_the_folder_and_into_the_hub_caches_blobs_load(saved, tmp_path):
    inside = sharded_copy(saved, tmp_path / "inside", "model-2.safetensors")
    (inside / "model-2.safetensors").rename(inside / "real.safetensors")
    (inside / "model-2.safetensors").symlink_to("real.safetensors")
    KimiK3ForCausalLM.from_pretrained(inside)
    repository = tmp_path / "models--someone--k3"
    snapshot = repository / "snapshots" / "0123abcd"
    (repository / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in saved.iterdir():  # the hub cache's layout: snapshot files link to ../../blobs/<hash>
        shutil.copy(path, repository / "blobs" / path.name)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", path.name))
    KimiK3ForCausalLM.from_pretrained(snapshot)


def test_malformed_or_oversized_index_is_refused_in_one_line_naming_it(saved, tmp_path):
    folder = sharded_copy(saved, tmp_path / "bad_index", "model-2.safetensors")
    (folder / INDEX).write_text('{"weight_map": [1, 2]}')
    with pytest.raises(ValueError, match=rf"{INDEX} is not a shard index") as error:
        KimiK3ForCausalLM.from_pretrained(folder)
    assert "\n" not in str(error.value)
    with open(folder / INDEX, "w") as index:
        index.truncate(100_000_001)  # sparse: no disk used
    with pytest.raises(ValueError, match=rf"{INDEX} holds 100,000,001 bytes, more than the 100,000,000"):
        KimiK3ForCausalLM.from_pretrained(folder)


def test_safetensors_header_length_beyond_the_file_is_refused_naming_the_shard(saved, tmp_path):
    folder = tmp_path / "huge_header"
    shutil.copytree(saved, folder)
    with open(folder / "model.safetensors", "r+b") as shard:
        shard.write((2**62).to_bytes(8, "little"))
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be read") as error:
        KimiK3ForCausalLM.from_pretrained(folder)
    assert "\n" not in str(error.value)


def test_regular_file_check_names_devices_and_missing_files():
    with pytest.raises(ValueError, match="/dev/zero is not a regular file"):
        checked_regular_file("/dev/zero")
    with pytest.raises(ValueError, match="/nonexistent/x cannot be read: No such file"):
        checked_regular_file("/nonexistent/x")


def test_converter_refuses_a_fifo_shard_a_link_out_and_a_missing_folder_in_one_line(saved, tmp_path, capsys):
    fifo_folder = sharded_copy(saved, tmp_path / "fifo", "pipe.safetensors")
    os.mkfifo(fifo_folder / "pipe.safetensors")
    returned = []
    worker = threading.Thread(target=lambda: returned.append(convert.main(
        ["to-release", str(fifo_folder), str(tmp_path / "out1"), "--no_progress"]
    )), daemon=True)  # fmt: skip
    worker.start()
    worker.join(HANG_CEILING_S)
    if worker.is_alive():  # a writer end releases the blocked reader, then the test fails
        os.close(os.open(fifo_folder / "pipe.safetensors", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the converter blocked on a FIFO shard")
    assert returned == [2]
    assert "pipe.safetensors is not a regular file" in capsys.readouterr().err
    leaking = tmp_path / "leaking"
    shutil.copytree(saved, leaking)
    (tmp_path / "secret").write_text("token")
    (leaking / "notes.txt").symlink_to(tmp_path / "secret")
    assert convert.main(["from-release", str(leaking), str(tmp_path / "out2"), "--no_progress"]) == 2
    error = capsys.readouterr().err
    assert "notes.txt resolves to" in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "out2").exists()
    assert convert.main(["from-release", str(tmp_path / "missing"), str(tmp_path / "out3"), "--no_progress"]) == 2
    assert "missing is not a folder" in capsys.readouterr().err
