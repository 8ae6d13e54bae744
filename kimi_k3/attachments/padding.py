"""Which tokens of the forward in progress are real, and where its packed documents begin, for statistics that must
not count padding nor pairs of tokens from two documents.

The model needs no such record (its attention masks handle padding and packing), so recorders that attach from
outside (Quantile Balancing's router statistics, QK-Clip's logit maxima) read it from the one `PaddingTracker` of the
model's decoder stack, which every attachment shares: one pre-hook per model, however many features record.
"""

import inspect
import weakref

import torch
from torch import nn

from kimi_k3.attachments.handle import Attachment
from kimi_k3.attachments.seams import decoder_stack
from packing_kimi_k3 import packed_document_starts

# decoder stack -> its tracker, while some attachment uses it.
_TRACKERS: "weakref.WeakKeyDictionary[nn.Module, PaddingTracker]" = weakref.WeakKeyDictionary()


def shared_padding(model: nn.Module, attachment: Attachment) -> "PaddingTracker":
    """The padding tracker of ``model``'s decoder stack, registered by its first user; ``attachment.remove()`` ends
    this use, and the last one removes the tracker's hook."""
    stack = decoder_stack(model)
    tracker = _TRACKERS.get(stack)
    if tracker is None:
        tracker = _TRACKERS[stack] = PaddingTracker(stack)
    tracker.users += 1
    attachment.add(tracker.release)
    return tracker


class PaddingTracker:
    """Keeps ``token_mask`` [batch·seq] (True = real token, in the flattened order routers see), ``document_starts``
    [batch, seq] (True where a packed document begins, as the model reads them) and ``batch_shape`` (batch, seq) of
    the current forward.

    A forward pre-hook on the decoder stack reads the call's 2-D ``attention_mask`` (its last ``seq`` columns, as
    cached steps prepend past positions); the mask is None for an unpadded call or a custom 4-D mask. The document
    starts come from the call's packing keys through the model's own `packed_document_starts`; None when unpacked.
    """

    def __init__(self, stack: nn.Module):
        self._stack = weakref.ref(stack)  # the registry's key: a strong reference would keep the model alive
        self.token_mask: torch.Tensor | None = None
        self.document_starts: torch.Tensor | None = None
        self.batch_shape: tuple[int, int] | None = None
        self.users = 0
        self._signature = inspect.signature(stack.forward)
        self._handle = stack.register_forward_pre_hook(self._capture, with_kwargs=True)

    def _capture(self, stack: nn.Module, args: tuple, kwargs: dict) -> None:
        call = self._signature.bind_partial(*args, **kwargs).arguments
        mask = call.get("attention_mask")
        inputs = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
        self.token_mask = self.document_starts = self.batch_shape = None
        if inputs is None:
            return
        self.batch_shape = tuple(inputs.shape[:2])
        if mask is not None and mask.ndim == 2:
            self.token_mask = mask[:, -inputs.shape[1] :].bool().reshape(-1)
        self.document_starts = packed_document_starts(inputs, mask, call.get("position_ids"), call.get("kwargs", {}))

    def rows(self, num_rows: int) -> torch.Tensor | None:
        """The mask for a tensor of ``num_rows`` token rows; an error if the rows are not the forward's tokens."""
        if self.token_mask is not None and self.token_mask.numel() != num_rows:
            raise ValueError(
                f"a recorder saw {num_rows} token rows but the forward's attention_mask covers "
                f"{self.token_mask.numel()} tokens; record only through the model's own forward"
            )
        return self.token_mask

    def release(self) -> None:
        """One user fewer; the last one removes the hook."""
        self.users -= 1
        if self.users == 0:
            self._handle.remove()
            stack = self._stack()
            if stack is not None:
                _TRACKERS.pop(stack, None)


def masked_counts(index: torch.Tensor, token_mask: torch.Tensor | None, size: int) -> torch.Tensor:
    """Counts [size] (int64) of the values of ``index`` [N, m] in the rows where ``token_mask`` [N] is True.

    Padding rows go to a spare slot that is dropped. Unlike boolean indexing, or ``bincount`` on a GPU, nothing here
    needs a size that depends on the data, so recording statistics never waits for the device.
    """
    if token_mask is not None:
        index = index.masked_fill(~token_mask[:, None], size)
    ones = torch.ones((), dtype=torch.int64, device=index.device).expand(index.numel())
    counts = torch.zeros(size + 1, dtype=torch.int64, device=index.device)
    return counts.scatter_add_(0, index.reshape(-1), ones)[:size]
