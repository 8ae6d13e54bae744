"""transformers' own model test mixins, from the test sources of the installed transformers release.

Every model inside transformers passes `ModelTesterMixin`, `ConfigTester` and `TrainingTesterMixin`; they are the
contract a transformers user relies on. The release's sdist on the package index carries the top-level files of its
``tests/`` folder (not ``tests/models``, ``tests/generation``, ``tests/exporters`` or ``tests/utils``). This module
downloads that sdist with pip (the package index, never a model hub), caches its ``tests/*.py`` under
``~/.cache/kimi-k3/transformers-tests/<version>/`` (or ``$KIMI_K3_TRANSFORMERS_TESTS``), and makes them importable as
the package ``transformers_tests``.

Three modules the sdist leaves out are imported by those files; each gets a stand-in here:
- ``generation/test_utils.py``: ``GenerationTesterMixin``, an empty mixin. The generation contract (greedy, sampling,
  beam search, cached == uncached, left padding, every cache implementation) is ``tests/test_generation.py``.
- ``exporters/test_export.py``: ``ExportTesterMixin``, an empty mixin (``torch.export`` tests are not run).
- ``utils/test_configuration_utils.py``: ``config_common_kwargs``, the common `PretrainedConfig` arguments, each
  with a non-default value (what ``ConfigTester.check_config_arguments_init`` sets and reads back).
"""

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

from tests.conftest import HANG_CEILING_S

PACKAGE = "transformers_tests"
MIXIN_FILES = ("test_modeling_common.py", "test_configuration_common.py", "test_training_mixin.py")

STAND_INS = {
    "generation/test_utils.py": '''"""Stand-in: the sdist does not ship tests/generation (kimi-k3 tests generation itself)."""


class GenerationTesterMixin:
    pass
''',
    "exporters/test_export.py": '''"""Stand-in: the sdist does not ship tests/exporters."""


class ExportTesterMixin:
    pass
''',
    "utils/test_configuration_utils.py": '''"""Stand-in: the common PretrainedConfig arguments, each set to a value that is not its default."""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "tie_word_embeddings": True,
    "chunk_size_feed_forward": 5,
    "architectures": ["KimiK3ForCausalLM"],
    "id2label": {0: "zero", 1: "one", 2: "two"},
    "label2id": {"zero": 0, "one": 1, "two": 2},
    "problem_type": "regression",
    "bos_token_id": 3,
    "pad_token_id": 4,
    "eos_token_id": 5,
}
''',
}


class SuiteUnavailable(RuntimeError):
    pass


def cache_folder(version: str) -> Path:
    root = os.environ.get("KIMI_K3_TRANSFORMERS_TESTS")
    return Path(root) if root else Path.home() / ".cache" / "kimi-k3" / "transformers-tests" / version


def download_test_sources(version: str, target: Path) -> None:
    """The ``tests/*.py`` files of transformers ``version``'s sdist, written into ``target`` (all or nothing)."""
    with tempfile.TemporaryDirectory() as work:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                   f"transformers=={version}", "--dest", work]
        result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_CEILING_S)
        sdists = list(Path(work).glob("transformers-*.tar.gz"))
        if result.returncode != 0 or not sdists:
            raise SuiteUnavailable(f"pip could not download the transformers {version} sdist: "
                                   f"{(result.stderr or result.stdout).strip().splitlines()[-1:]}")
        staging = Path(work) / PACKAGE
        staging.mkdir()
        with tarfile.open(sdists[0]) as sdist:
            for member in sdist.getmembers():
                parts = Path(member.name).parts
                if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                    (staging / parts[2]).write_bytes(sdist.extractfile(member).read())
        missing = [name for name in MIXIN_FILES if not (staging / name).exists()]
        if missing:
            raise SuiteUnavailable(f"the transformers {version} sdist has no tests/{missing[0]}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(staging), target)


def install_stand_ins(package: Path) -> None:
    (package / "__init__.py").touch()
    for relative, text in STAND_INS.items():
        path = package / relative
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)


def import_suite(version: str = transformers.__version__):
    """The ``transformers_tests`` package of the installed release, downloading it once."""
    root = cache_folder(version)
    package = root / PACKAGE
    if not all((package / name).exists() for name in MIXIN_FILES):
        download_test_sources(version, package)
    install_stand_ins(package)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(PACKAGE)
