"""The repository itself: no leftovers of an unfinished merge, functions short enough to read in one screen, no module
reaching into another's underscored names, every Markdown file a text cites present in the repository, and the
README's commands the ones CI runs."""

import ast
import functools
import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT

MARKERS = ("<<<<<<< ", ">>>>>>> ")
LONGEST_FUNCTION = 60
# Modules of this repository; an underscored name of any other package is a borrowed private API (listed, with why,
# in tests/test_transformers_api.py).
PROJECT_MODULES = re.compile(r"^(kimi_k3|modeling_kimi_k3|configuration_kimi_k3|checkpoint_format_kimi_k3|tests|"
                             r"benchmarks|scripts)(\.|$)")
# A path ending in .md: a word of path characters, not a URL, not inside a longer word.
CITED_MARKDOWN = re.compile(r"(?<![\w./-])(?:\.\.?/)?[\w.-]+(?:/[\w.-]+)*\.md\b")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".txt", ""}


@functools.cache
def tracked_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / name for name in names if (ROOT / name).is_file()]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def test_no_merge_conflict_markers_are_committed():
    leftovers = []
    for path in tracked_files():
        lines = (text_of(path) or "").splitlines()
        leftovers += [f"{path.relative_to(ROOT)}:{number}" for number, line in enumerate(lines, 1)
                      if line.startswith(MARKERS)]
    assert not leftovers, f"unresolved merge conflicts at {leftovers}"


@functools.cache
def python_trees() -> list[tuple[Path, ast.Module]]:
    return [(path.relative_to(ROOT), ast.parse(path.read_text(encoding="utf-8")))
            for path in tracked_files() if path.suffix == ".py"]


def test_no_function_is_longer_than_sixty_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in python_trees() for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION]
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"


def test_no_module_imports_another_modules_underscored_names():
    private = [f"{path}:{node.lineno} {alias.name} from {node.module}"
               for path, tree in python_trees() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level == 0 and PROJECT_MODULES.match(node.module or "")
               for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not private, f"imports of another module's private names: {private}"


def cited_markdown(path: Path) -> list[str]:
    if path.suffix not in TEXT_SUFFIXES:
        return []
    return CITED_MARKDOWN.findall(text_of(path) or "")


def resolves(citation: str, cited_in: Path, files: list[Path]) -> bool:
    """A citation names a file relative to the citing file's folder or to the repository root, or (a bare name in
    code, such as a template's) the end of a tracked file's path."""
    if any(candidate.resolve().is_file() for candidate in (cited_in.parent / citation, ROOT / citation)):
        return True
    return any(path.as_posix().endswith(f"/{citation.removeprefix('./')}") for path in files)


def test_every_cited_markdown_file_is_in_the_repository():
    files = [path for path in tracked_files() if path != Path(__file__)]  # this file cites examples
    missing = [f"{path.relative_to(ROOT)}: {citation}" for path in files
               for citation in cited_markdown(path) if not resolves(citation, path, files)]
    assert not missing, f"cited Markdown files the repository does not hold: {missing}"


def test_the_citation_check_sees_paths_and_bare_names_but_not_urls():
    text = "see docs/training.md, training.md §2 and https://example.com/notes.md or [x](../README.md)"
    assert CITED_MARKDOWN.findall(text) == ["docs/training.md", "training.md", "../README.md"]
    files = tracked_files()
    assert not resolves("training.md", ROOT / "kimi_k3" / "optim" / "muon.py", files)
    assert resolves("../README.md", ROOT / "docs" / "design.md", files)


def test_the_readme_fresh_machine_commands_are_the_ones_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Fresh machine: two commands", 1)[1].split("\n## ", 1)[0]
    setup, test = re.findall(r"```bash\n(.+?)\n```", section)
    assert test == 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q'
    assert setup == test.replace("python -m pytest -q", "kimi-k3-train")
    assert test in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert len(readme.splitlines()) <= 250  # an introduction; the manual is in docs/
