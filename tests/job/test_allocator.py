"""The training command restarts itself under TCMalloc where the machine has it, once, with the same arguments."""

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_k3.job import allocator
from kimi_k3.job.allocator import (
    ALLOCATOR_VARIABLE,
    RESTARTED_VARIABLE,
    AllocatorChoiceError,
    allocator_choice,
    allocator_name,
    find_tcmalloc,
    loaded_allocator,
)
from tests.conftest import HANG_CEILING_S

REPO = Path(__file__).resolve().parents[2]
# Where the machine has no TCMalloc nothing restarts anyway, and a test that nothing restarts could not fail there.
needs_tcmalloc = pytest.mark.skipif(not sys.platform.startswith("linux") or find_tcmalloc() is None,
                                    reason="needs Linux and TCMalloc")
# Prints its PID and the mapped TCMalloc before and after the restart, and the arguments it ends up with.
PROBE = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
from kimi_k3.job.allocator import loaded_allocator, restart_under_tcmalloc
print("before", os.getpid(), loaded_allocator(), flush=True)
restart_under_tcmalloc()
print("after", os.getpid(), loaded_allocator(), sys.argv[1:])
"""


def run_probe(*arguments: str, **environ: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items()
           if key not in ("LD_PRELOAD", ALLOCATOR_VARIABLE, RESTARTED_VARIABLE)}
    return subprocess.run([sys.executable, "-c", PROBE, *(arguments or ("--seed", "3"))], env={**env, **environ},
                          capture_output=True, text=True, timeout=HANG_CEILING_S)


def test_the_choice_defaults_to_tcmalloc_and_names_the_variable_when_wrong():
    assert allocator_choice({}) == "tcmalloc"
    assert allocator_choice({ALLOCATOR_VARIABLE: " System "}) == "system"
    expected = f"{ALLOCATOR_VARIABLE} must be one of tcmalloc, system, got 'jemalloc'"
    with pytest.raises(AllocatorChoiceError, match=expected):
        allocator_choice({ALLOCATOR_VARIABLE: "jemalloc"})


def test_a_mapped_tcmalloc_is_found_in_the_memory_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 00:00 0 \n"
        "7f10-7f20 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 1235 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n"
    )
    assert loaded_allocator(maps) == "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10"
    maps.write_text("7f10-7f20 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert allocator_name(loaded_allocator(maps)) == "jemalloc"
    maps.write_text("7f10-7f20 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator_name(loaded_allocator(maps)) == "system"
    assert loaded_allocator(tmp_path / "missing") is None


@needs_tcmalloc
def test_the_process_restarts_once_under_tcmalloc_with_its_arguments():
    result = run_probe()
    assert result.returncode == 0, result.stderr
    first, restarted, after = (line.split(" ", 3) for line in result.stdout.splitlines())
    assert first[0] == "before" and first[2] == "None"
    assert restarted[0] == "before" and Path(restarted[2]).name.startswith("libtcmalloc")
    assert after[0] == "after" and first[1] == restarted[1] == after[1]  # one PID: the process replaced itself
    assert after[3] == "['--seed', '3']" and "warning" not in result.stderr


@needs_tcmalloc
def test_the_system_choice_and_a_help_request_keep_the_process_as_it_is():
    for result in run_probe(**{ALLOCATOR_VARIABLE: "system"}), run_probe("--help"):
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("before") == 1 and "after" in result.stdout


@needs_tcmalloc
@pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None, reason="needs jemalloc")
def test_an_allocator_the_user_preloaded_is_kept():
    result = run_probe(LD_PRELOAD=ctypes.util.find_library("jemalloc"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("before") == 1 and "libjemalloc" in result.stdout


def test_a_preload_the_loader_ignored_is_not_retried():
    """The restarted process carries a marker: if the loader could not preload the library, it says so and goes on
    rather than restarting forever."""
    result = run_probe(LD_PRELOAD="/nonexistent/libtcmalloc_minimal.so.4", **{RESTARTED_VARIABLE: "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("before") == 1
    assert "warning: the dynamic loader did not preload '/nonexistent/libtcmalloc_minimal.so.4'" in result.stderr


def test_a_wrong_choice_stops_the_command_with_status_2():
    result = run_probe(**{ALLOCATOR_VARIABLE: "fast"})
    assert result.returncode == 2
    assert f"kimi-k3-train: error: {ALLOCATOR_VARIABLE} must be one of tcmalloc, system, got 'fast'" in result.stderr


def test_without_tcmalloc_the_job_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(allocator, "loaded_allocator", lambda: None)
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    assert "apt-get install libtcmalloc-minimal4" in allocator.allocator_description()
    monkeypatch.setattr(allocator, "loaded_allocator", lambda: "/usr/lib/libtcmalloc_minimal.so.4")
    description = allocator.allocator_description()
    assert description.startswith("memory allocator: TCMalloc (/usr/lib/libtcmalloc_minimal.so.4)")


def test_a_machine_with_an_accelerator_keeps_its_allocator(monkeypatch):
    """TCMalloc is CPU-step machinery: where torch sees an accelerator the job trains there, and nothing restarts."""
    restarts = []
    monkeypatch.setattr(allocator.os, "execve", lambda *args: restarts.append(args))
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.delenv(ALLOCATOR_VARIABLE, raising=False)
    monkeypatch.delenv(RESTARTED_VARIABLE, raising=False)
    monkeypatch.setattr(allocator, "loaded_allocator", lambda: None)
    monkeypatch.setattr(allocator.torch.accelerator, "is_available", lambda: True)
    allocator.restart_under_tcmalloc()
    assert restarts == []
    monkeypatch.setattr(allocator.torch.accelerator, "is_available", lambda: False)
    allocator.restart_under_tcmalloc()
    assert len(restarts) == 1  # the same process on a CPU-only machine restarts
