"""The repository itself: no leftovers of an unfinished merge, functions short enough to read in one screen, no module
reaching into another's underscored names, imports that follow one layering without cycles, every Markdown file a
text cites present in the repository, the README's commands the ones CI runs, no test limited by wall-clock time
below the hang ceiling, and no test folder named after a package it would hide."""

import ast
import functools
import importlib.util
import re
import subprocess
from collections import defaultdict
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
# The training package's sub-packages, lowest layer first: each imports only from layers below its own, the package's
# own __init__ and the model files at the repository root (which sit below every layer and never import the package).
# The lab, the ablation suite, is on top, so nothing of the library depends on it.
PACKAGE_LAYERS = (
    ("attachments",),
    ("checkpoint", "kernels", "parallel", "text", "vision"),
    ("optim", "policies", "publishing", "quantization"),
    ("job",),
    ("ablation", "planning"),
)


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


# Packages the model's ecosystem imports by their top-level names, installed or not on this machine: a folder of
# tests/ with one of these names would stand in for the package in any script run as ``python tests/...``.
ECOSYSTEM_MODULES = {"kernels", "fla", "triton", "flash_attn", "causal_conv1d", "torchao", "bitsandbytes", "liger_kernel",
                     "deepspeed", "peft", "trl", "datasets", "accelerate", "safetensors", "tokenizers", "vllm", "sglang"}


def test_no_test_folder_or_module_takes_the_name_of_an_importable_package():
    """``python tests/script.py`` puts tests/ first on the path, so ``tests/kernels/`` once replaced the hub's
    ``kernels`` package inside transformers' own imports."""
    entries = {path.stem if path.suffix == ".py" else path.name for path in (ROOT / "tests").iterdir()
               if not path.name.startswith(("_", ".")) and (path.suffix == ".py" or path.is_dir())}
    shadowing = sorted(name for name in entries if name in ECOSYSTEM_MODULES or importlib.util.find_spec(name))
    assert not shadowing, f"tests/ entries named after importable packages: {shadowing}"


@functools.cache
def python_trees() -> list[tuple[Path, ast.Module]]:
    return [(path.relative_to(ROOT), ast.parse(path.read_text(encoding="utf-8")))
            for path in tracked_files() if path.suffix == ".py"]


# A time limit written as a number literal, as a keyword, a default or a constant named after a timeout.
NUMERIC_TIME_LIMIT = re.compile(r"\btimeout\w*\s*(?::\s*float\s*)?=\s*\d", re.IGNORECASE)


def test_no_test_limits_its_subprocesses_below_the_hang_ceiling():
    """A correctness test does not depend on how fast the machine is: its subprocesses wait up to
    ``tests.conftest.HANG_CEILING_S``, which only a hang reaches (a loaded machine once failed a 300 s limit)."""
    limited = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in tracked_files() if path.suffix == ".py" and path.parts[len(ROOT.parts)] == "tests"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if NUMERIC_TIME_LIMIT.search(line)
    ]
    assert not limited, f"use tests.conftest.HANG_CEILING_S instead of a numeric time limit: {limited}"


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


def module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(node: ast.AST, path: Path) -> list[str]:
    """Absolute names of the modules an import statement in ``path`` names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        return [node.module]
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return [".".join([*base, node.module] if node.module else base)]


def layering_unit(module: str) -> str | None:
    """What the layering orders: a model file (``modeling_kimi_k3``), the package itself (``kimi_k3``), a sub-package
    (``kimi_k3.job``), or the benchmarks, scripts and tests (which nothing importable may import); None outside the
    repository."""
    top, *rest = module.split(".")
    if top == "kimi_k3":
        return "kimi_k3" if not rest else f"kimi_k3.{rest[0]}"
    if PROJECT_MODULES.match(module):
        return top
    if (ROOT / f"{top}.py").is_file():
        return top
    return None


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """Which layering unit imports which, from the real import statements of the model files and the package (imports
    inside functions included: they run too)."""
    edges = defaultdict(set)
    for path, tree in python_trees():
        if not (path.parts[0] == "kimi_k3" or len(path.parts) == 1):
            continue
        source = layering_unit(module_name(path))
        for node in ast.walk(tree):
            targets = {layering_unit(name) for name in imported_modules(node, path)}
            edges[source] |= targets - {None, source}
    return {source: frozenset(targets) for source, targets in edges.items()}


def import_cycle(graph: dict[str, frozenset[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the path that closes it, or None (depth-first search)."""
    state, stack = {}, []

    def visit(unit: str) -> list[str] | None:
        state[unit] = "open"
        stack.append(unit)
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[unit] = "done"
        stack.pop()
        return None

    return next(filter(None, (visit(unit) for unit in sorted(graph) if unit not in state)), None)


def layering_violations(graph: dict[str, frozenset[str]], layers=PACKAGE_LAYERS) -> list[str]:
    """Imports against the declared order: a sub-package importing its own layer or one above, the package or a model
    file importing a sub-package, anything importable importing the benchmarks, scripts or tests."""
    rank = {f"kimi_k3.{name}": level for level, names in enumerate(layers) for name in names}
    outside = {"benchmarks", "scripts", "tests"}
    violations = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target in outside:
                violations.append(f"{source} imports {target}")
            elif target.startswith("kimi_k3") and target != "kimi_k3" and rank.get(source, -1) <= rank[target]:
                violations.append(f"{source} imports {target}, which is not in a lower layer")
            elif target == "kimi_k3" and not source.startswith("kimi_k3."):
                violations.append(f"{source} imports the training package")
    return violations


def test_the_package_and_the_model_files_import_one_another_without_a_cycle():
    assert import_cycle(import_graph()) is None, f"import cycle: {' -> '.join(import_cycle(import_graph()))}"


def test_every_import_follows_the_declared_layering():
    found = {unit.removeprefix("kimi_k3.") for unit in import_graph() if unit.startswith("kimi_k3.")}
    declared = {name for names in PACKAGE_LAYERS for name in names}
    assert found == declared, f"sub-packages to declare in PACKAGE_LAYERS: {sorted(found - declared)}; " \
                              f"declared but gone: {sorted(declared - found)}"
    assert not layering_violations(import_graph()), layering_violations(import_graph())


def test_the_layering_checks_see_cycles_upward_imports_and_relative_imports():
    assert import_cycle({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"})}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": frozenset({"b"}), "b": frozenset()}) is None
    upward = {"kimi_k3.policies": frozenset({"kimi_k3.job"}), "modeling_kimi_k3": frozenset({"kimi_k3"}),
              "kimi_k3.job": frozenset({"kimi_k3.policies", "benchmarks"})}
    assert layering_violations(upward) == [
        "kimi_k3.job imports benchmarks",
        "kimi_k3.policies imports kimi_k3.job, which is not in a lower layer",
        "modeling_kimi_k3 imports the training package",
    ]
    relative = ast.parse("from .configuration_kimi_k3 import KimiK3Config\nfrom . import handle").body
    assert imported_modules(relative[0], Path("modeling_kimi_k3.py")) == ["configuration_kimi_k3"]
    assert imported_modules(relative[1], Path("kimi_k3/attachments/__init__.py")) == ["kimi_k3.attachments"]


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


def test_the_benchmark_readme_is_short_and_names_every_dated_record():
    """How to run and the current figures in benchmarks/README.md; each investigation whole in its own record, named
    ``<date>_<topic>_<machine>.md`` and linked from the README."""
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    records = sorted(path.name for path in (ROOT / "benchmarks" / "records").glob("*.md"))
    assert records, "benchmarks/records/ holds no record"
    misnamed = [name for name in records if not re.fullmatch(r"\d{4}-\d{2}-\d{2}_[a-z0-9_]+_[a-z0-9-]+\.md", name)]
    assert not misnamed, f"records not named <date>_<topic>_<machine>.md: {misnamed}"
    unlinked = [name for name in records if f"(records/{name})" not in readme]
    assert not unlinked, f"records benchmarks/README.md does not link: {unlinked}"
