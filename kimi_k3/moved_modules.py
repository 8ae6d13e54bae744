"""The modules of the flat ``kimi_k3`` package of release 0.1, and where each lives now.

``import kimi_k3.muon`` (or ``from kimi_k3.qk_clip import QKClip``) keeps working for one release: it warns with a
``FutureWarning`` naming the new path and gives the new module itself, so classes, functions and module state are
the same objects under both names. The table is the only place that knows the old names.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED_MODULES = {
    "kimi_k3.balance_metrics": "kimi_k3.policies.balance_metrics",
    "kimi_k3.data": "kimi_k3.text.corpus",
    "kimi_k3.distributed": "kimi_k3.parallel.sharding",
    "kimi_k3.expert_load": "kimi_k3.job.expert_load",
    "kimi_k3.fused_situ": "kimi_k3.kernels.fused_situ",
    "kimi_k3.hub": "kimi_k3.publishing.hub",
    "kimi_k3.model_card": "kimi_k3.publishing.model_card",
    "kimi_k3.muon": "kimi_k3.optim.muon",
    "kimi_k3.padding": "kimi_k3.attachments.padding",
    "kimi_k3.parallel_plan": "kimi_k3.planning.plan",
    "kimi_k3.parallel_verify": "kimi_k3.planning.verify",
    "kimi_k3.precision": "kimi_k3.optim.precision",
    "kimi_k3.qat": "kimi_k3.quantization.qat",
    "kimi_k3.qk_clip": "kimi_k3.policies.qk_clip",
    "kimi_k3.quantile_balancing": "kimi_k3.policies.quantile_balancing",
    "kimi_k3.release_format": "kimi_k3.checkpoint.release_format",
    "kimi_k3.resumable": "kimi_k3.job.resumable",
    "kimi_k3.run_folder": "kimi_k3.checkpoint.run_folder",
    "kimi_k3.split_newton_schulz": "kimi_k3.optim.split_newton_schulz",
    "kimi_k3.tokenizer": "kimi_k3.text.tokenizer",
    "kimi_k3.train": "kimi_k3.job.main",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module name of `MOVED_MODULES` to the module at its new path."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new_name = MOVED_MODULES[spec.name]
        # stacklevel counts frames outside the import system: 2 is the import statement, the line to change.
        warnings.warn(f"{spec.name} has moved to {new_name}; import it from there (the old path goes away in the "
                      "next release)", FutureWarning, stacklevel=2)
        module = importlib.import_module(new_name)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # The import system has just given the shared module object the old name's spec; it keeps its own.
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Serve the old names (once per process); after the regular finders, which find nothing at the old paths."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
