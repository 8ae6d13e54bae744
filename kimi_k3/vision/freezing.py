"""Which parts of a ``KimiK3ForConditionalGeneration`` train: everything, everything but the vision tower (the
usual fine-tune of a pre-trained tower), or the projector alone (aligning a new tower or language model)."""

TRAINED_PARTS = {
    "all": ("vision_tower.", "mm_projector.", "language_model."),
    "projector_and_language_model": ("mm_projector.", "language_model."),
    "projector": ("mm_projector.",),
}


def train_parts(model, parts: str) -> list[str]:
    """Set ``requires_grad`` so that only ``parts`` (a key of `TRAINED_PARTS`) train; returns the frozen names."""
    if parts not in TRAINED_PARTS:
        raise ValueError(f"--vision_train_parts {parts!r}; allowed: {sorted(TRAINED_PARTS)}")
    frozen = []
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(TRAINED_PARTS[parts]))
        if not parameter.requires_grad:
            frozen.append(name)
    return frozen
