"""Training text: corpora as ``datasets`` splits of token blocks, and the byte-level BPE tokenizer."""
