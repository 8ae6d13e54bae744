"""Packed documents: several documents in one row, as transformers' ``DataCollatorWithFlattening`` and TRL's
padding-free packing lay them out. The model reads the boundaries once per forward (`packed_document_starts`); every
mixer restarts at them: the KDA kernels inside their chunk structure, the short convolutions by keeping in-document
taps (`positions_in_documents`), MLA through a block-diagonal causal mask (`same_document`).

Packed rows are full forwards: they never continue a cache, and ``generate`` refuses packed prompts. The file imports
only torch, so it ships beside the model file in every saved folder.
"""

from collections.abc import Callable

import torch


# The keys a padding-free collator adds beside `position_ids` that mark documents (`max_length_q`/`max_length_k` only
# size flash-attention kernels, and are not needed here).
PACKED_SEQUENCE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def packed_document_starts(inputs_embeds, attention_mask, position_ids, packing: dict) -> torch.Tensor | None:
    """[B, T] bool, True at every token that begins a document after another one in its row; None when the call
    follows no packing convention.

    A document begins wherever any given convention marks one: flash-attention's cumulative lengths over the flattened
    batch (``cu_seq_lens_q``, ``cu_seq_lens_k``), a change of ``seq_idx``, or ``position_ids`` that do not continue
    from the previous token. As in transformers, position ids mark documents only without a 2-D ``attention_mask``:
    with padding they are positions, and left padding makes them restart.
    """
    batch_size, seq_len = inputs_embeds.shape[:2]
    starts = [
        _starts_from_cumulative_lengths(packing[name], batch_size, seq_len, name)
        for name in ("cu_seq_lens_q", "cu_seq_lens_k")
        if packing.get(name) is not None
    ]
    if packing.get("seq_idx") is not None:
        document_index = _as_rows(packing["seq_idx"], batch_size, seq_len, "seq_idx")
        starts.append(_first_column_false(document_index[:, 1:] != document_index[:, :-1]))
    if position_ids is not None and attention_mask is None:
        positions = _as_rows(position_ids, batch_size, seq_len, "position_ids")
        starts.append(_first_column_false(positions[:, 1:] != positions[:, :-1] + 1))
    if not starts:
        return None
    return torch.stack([marked.to(inputs_embeds.device) for marked in starts]).any(0)


def _as_rows(values: torch.Tensor, batch_size: int, seq_len: int, name: str) -> torch.Tensor:
    """A per-token tensor [B, T] ([1, T] broadcast over the batch, as collators of one packed row give it)."""
    if values.ndim != 2 or values.shape[1] != seq_len or values.shape[0] not in (1, batch_size):
        raise ValueError(
            f"`{name}` must have shape [batch={batch_size}, seq_len={seq_len}] or [1, {seq_len}], "
            f"got {tuple(values.shape)}."
        )
    return values.expand(batch_size, -1)


def _first_column_false(later_starts: torch.Tensor) -> torch.Tensor:
    return torch.cat([later_starts.new_zeros(later_starts.shape[0], 1), later_starts], dim=1)


def _starts_from_cumulative_lengths(cu_seq_lens, batch_size: int, seq_len: int, name: str) -> torch.Tensor:
    """Document starts from cumulative lengths [n + 1] over the B·T tokens of the flattened batch; a row's first
    token is a row start, not a start after another document."""
    total = batch_size * seq_len
    if cu_seq_lens.ndim != 1 or cu_seq_lens.numel() < 2 or cu_seq_lens.is_floating_point():
        raise ValueError(
            f"`{name}` must be a 1-D integer tensor of cumulative document lengths [0, ..., {total}], "
            f"got dtype {cu_seq_lens.dtype} and shape {tuple(cu_seq_lens.shape)}."
        )
    # Reading the values back waits for the device: checked on CPU only, as `input_ids` are.
    if cu_seq_lens.device.type == "cpu" and not torch.compiler.is_compiling():
        if cu_seq_lens[0] != 0 or cu_seq_lens[-1] != total or (cu_seq_lens.diff() < 0).any():
            raise ValueError(
                f"`{name}` must rise from 0 to batch x seq_len = {total} without decreasing, "
                f"got {cu_seq_lens.tolist()}."
            )
    starts = torch.zeros(total + 1, dtype=torch.bool, device=cu_seq_lens.device)
    starts = starts.index_fill(0, cu_seq_lens.long(), True)[:total].view(batch_size, seq_len)
    return _first_column_false(starts[:, 1:])


def positions_in_documents(document_starts: torch.Tensor) -> torch.Tensor:
    """Each token's index [B, T] inside its document (counted from the row start for a row's first document)."""
    index = torch.arange(document_starts.shape[1], device=document_starts.device).expand_as(document_starts)
    return index - torch.where(document_starts, index, 0).cummax(-1).values


def same_document(document_starts: torch.Tensor) -> Callable:
    """transformers' mask-function form (``and_mask_function`` of the mask builders): query and key share a document.

    Only for full forwards, where key index = query index (packed documents never continue a cache)."""
    document_ids = document_starts.cumsum(-1)

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return document_ids[batch_idx, q_idx] == document_ids[batch_idx, kv_idx]

    return inner_mask


def packing_markers(kwargs: dict, restarting_positions) -> str | None:
    """What marks the call's rows as packed documents, for an error message; None for one sequence per row."""
    given = [f"`{name}`" for name in PACKED_SEQUENCE_KEYS if kwargs.get(name) is not None]
    if restarting_positions:
        given.append("restarting `position_ids`")
    return ", ".join(given) or None


def packed_prompt_markers(model_kwargs: dict) -> str | None:
    """What marks ``generate``'s prompts as packed documents: a packing key, or position ids that restart where no
    attention mask makes them positions."""
    position_ids = model_kwargs.get("position_ids")
    restarting = (
        isinstance(position_ids, torch.Tensor)
        and model_kwargs.get("attention_mask") is None
        and bool((position_ids.diff(dim=-1) != 1).any())
    )
    return packing_markers(model_kwargs, restarting)


def check_continues_the_cache(document_starts: torch.Tensor, packing: dict) -> None:
    """A forward after cached tokens continues one sequence per row: packed documents are refused there."""
    markers = packing_markers(packing, document_starts.any())
    if markers:
        raise ValueError(
            f"Packed documents ({markers}) cannot continue a cache: pack whole documents into forwards without cached "
            "tokens."
        )
