"""What attaching a feature did to a model, undone by one ``remove()``.

Every attachment (Quantile Balancing's statistics, QK-Clip, QAT, fused kernels) returns an `Attachment`: the hooks
it registered, its use of the shared padding tracker, a policy's optimizer step hook, and the module attributes it
set. Removing it restores the plain model. A module attribute belongs to one feature at a time: a second feature
that would set it is refused with the names of both, which is what keeps two features from undoing each other.

Policies that change weights or buffers update from a step hook of the optimizer itself, as torchtitan updates its
MoE expert bias, so that they act the same under ``Trainer``, an accelerate loop or a plain ``torch`` loop.
"""

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

# module -> {attribute: the feature that holds it}; entries go away with their modules.
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, dict[str, str]]" = weakref.WeakKeyDictionary()
_UNSET = object()


class Attachment:
    """Removable record of one attached feature; also a context manager that removes it on exit."""

    def __init__(self, feature: str):
        self.feature = feature
        self._undo: list[Callable[[], None]] = []

    def add(self, removable) -> None:
        """Undo ``removable`` on `remove`: a hook handle (anything with ``remove()``) or a function to call."""
        self._undo.append(removable.remove if hasattr(removable, "remove") else removable)

    def claim_attribute(self, module: nn.Module, name: str) -> None:
        """Reserve ``module.name`` for this feature until `remove`; refused if another feature holds it.

        For attributes the feature sets and clears itself (QAT binds the expert weights during each forward).
        """
        owners = _OWNERS.setdefault(module, {})
        if name in owners:
            raise ValueError(
                f"{self.feature} cannot set {type(module).__name__}.{name}: {owners[name]} holds it; remove that "
                "attachment first"
            )
        owners[name] = self.feature
        self.add(lambda: _release(module, name))

    def set_attribute(self, module: nn.Module, name: str, value) -> None:
        """``module.name = value`` in the instance's ``__dict__`` (a ``forward`` swap, an observer), held by this
        feature; `remove` gives back the previous instance value, or none."""
        self.claim_attribute(module, name)
        previous = module.__dict__.get(name, _UNSET)
        module.__dict__[name] = value
        self.add(lambda: _restore(module, name, previous))

    def run_after_each_step(self, optimizer: torch.optim.Optimizer, function: Callable[[], None]) -> None:
        """Call ``function()`` after every step of ``optimizer``, until `remove`.

        The hook goes on the torch optimizer itself (inside accelerate's ``AcceleratedOptimizer``), so a step that
        a gradient scaler skips, or a gradient-accumulation micro-step, runs no update.
        """
        inner = unwrapped_optimizer(optimizer)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(
                f"{self.feature} updates after each step of a torch.optim.Optimizer (register_step_post_hook); got "
                f"{type(inner).__name__}"
            )
        self.add(inner.register_step_post_hook(lambda stepped, args, kwargs: function()))

    def remove(self) -> None:
        """Undo everything, the last change first; a second call does nothing."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


@contextlib.contextmanager
def undone_on_failure(attachment: Attachment) -> Iterator[Attachment]:
    """Build ``attachment`` inside: if attaching fails midway (a refused attribute, a wrong optimizer), what it had
    attached is removed before the error propagates, so a failed attachment leaves nothing behind."""
    try:
        yield attachment
    except BaseException:
        attachment.remove()
        raise


def unwrapped_optimizer(optimizer):
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def attribute_owners(module: nn.Module) -> dict[str, str]:
    """The attributes of ``module`` that attached features hold, with the feature holding each."""
    return dict(_OWNERS.get(module, {}))


def _restore(module: nn.Module, name: str, previous) -> None:
    if previous is _UNSET:
        module.__dict__.pop(name, None)
    else:
        module.__dict__[name] = previous


def _release(module: nn.Module, name: str) -> None:
    owners = _OWNERS.get(module, {})
    owners.pop(name, None)
    if not owners:
        _OWNERS.pop(module, None)
