"""kimi-k3-convert's options (shard sizes spelled as ``save_pretrained(max_shard_size=...)`` takes them) and refusals."""

import json

import pytest

from kimi_k3.checkpoint.convert import main as convert_main
from kimi_k3.checkpoint.convert import parse_size
from tests.conftest import tiny_config


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("20KB", 20_000),
                                            ("123", 123), (" 2GiB ", 2 * 2**30)])
def test_shard_sizes_read_as_transformers_reads_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1.5GB", "5TB", "five", ""])
def test_an_unreadable_shard_size_is_refused_in_one_line_naming_the_option_and_the_units(text, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        convert_main(["to-release", str(tmp_path / "ours"), str(tmp_path / "released"), "--max_shard_size", text])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == 2 and "--max_shard_size must be a whole number of bytes" in error
    assert "GiB" in error and repr(text) in error


@pytest.mark.parametrize("direction", ["to-release", "from-release"])
def test_a_config_json_the_config_refuses_is_one_line_naming_the_file_and_the_field(direction, tmp_path, capsys):
    tiny_config().save_pretrained(tmp_path / "source")
    saved = json.loads((tmp_path / "source" / "config.json").read_text())
    (tmp_path / "source" / "config.json").write_text(json.dumps({**saved, "num_experts_per_token": 9}))
    assert convert_main([direction, str(tmp_path / "source"), str(tmp_path / "target"), "--no_progress"]) == 2
    error = capsys.readouterr().err
    assert error == (f"kimi-k3-convert: error: {tmp_path / 'source'}/config.json: `num_experts_per_token` (9) must be "
                     "<= `num_experts` (8).\n")
    assert not (tmp_path / "target").exists()
