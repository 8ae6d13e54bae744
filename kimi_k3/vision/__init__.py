"""Image-text training: the embedded synthetic image set, image-caption datasets, the collator that pads images and
text for ``KimiK3ForConditionalGeneration``, and which parts of the model train."""
