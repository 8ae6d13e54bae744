"""The flat module paths of release 0.1 keep working for one release: each gives the module at its new path, with a
FutureWarning that names it and points at the import statement."""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

import kimi_k3
from kimi_k3.moved_modules import MOVED_MODULES


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_MODULES.items()))
def test_an_old_module_path_gives_the_new_module_and_warns_naming_it(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    namespace = {}
    with pytest.warns(FutureWarning, match=f"^{old} has moved to {new}; import it from there") as warned:
        exec(f"import {old} as moved", namespace)
    assert namespace["moved"] is importlib.import_module(new)
    assert namespace["moved"].__spec__.name == new  # the module keeps its own identity
    assert [warning.filename for warning in warned] == ["<string>"]  # the line to change


def test_names_import_from_an_old_path_as_the_same_objects(monkeypatch):
    monkeypatch.delitem(sys.modules, "kimi_k3.quantile_balancing", raising=False)
    with pytest.warns(FutureWarning, match="kimi_k3.policies.quantile_balancing"):
        from kimi_k3.quantile_balancing import QuantileBalancingCallback
    from kimi_k3.policies.quantile_balancing import QuantileBalancingCallback as moved

    assert QuantileBalancingCallback is moved


def test_every_new_path_exists_and_nothing_is_left_at_an_old_one():
    package = Path(kimi_k3.__file__).parent
    for old, new in MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, new
        name = old.removeprefix("kimi_k3.")
        assert not (package / f"{name}.py").exists() and not (package / name).exists(), old
