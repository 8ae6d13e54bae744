"""A byte-level BPE tokenizer trained on the training text, saved with ``tokenizer_class`` declared.

Byte level: every string encodes (no unknown token), so any prompt works at generation time. The tokenizer needs no
custom code, yet in a Kimi K3 model folder ``AutoTokenizer.from_pretrained(folder)`` asks to trust remote code:
transformers 5 resolves the folder's ``AutoConfig`` before its tokenizer files, and the config's ``auto_map`` names
``configuration_kimi_k3.py``. Load it with ``trust_remote_code=True`` (which runs only that configuration file) or
through ``PreTrainedTokenizerFast`` (which never reads config.json), as `load_tokenizer` does.
"""

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Ids 0, 1, 2 are KimiK3Config's default pad/bos/eos ids.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]


class TokenizerMismatchError(ValueError):
    """The tokenizer would produce ids the model has no embedding row for."""


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with ``vocab_size`` entries (fewer if the text has fewer merges), special tokens first."""
    minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= minimum:
        raise ValueError(f"--tokenizer_vocab_size must be > {minimum} (special tokens + 256 bytes), got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN
    )


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """A saved tokenizer folder with a ``tokenizer.json`` (ours or any other with an EOS token, which joins documents).

    Not ``AutoTokenizer``: it reads the folder's config.json first, and a Kimi K3 model folder's config is remote code
    (a trust prompt), which a tokenizer does not need.
    """
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    except Exception as error:  # json, tokenizers and transformers each report a malformed file in their own class
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"{path}: its tokenizer files cannot be read (malformed tokenizer.json?): {reason}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer_name_or_path {path}: the tokenizer has no EOS token to separate documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_tokenizer_fits(tokenizer, config) -> None:
    """Every id the tokenizer emits must index the model's embedding: len(tokenizer) <= config.vocab_size."""
    if len(tokenizer) > config.vocab_size:
        raise TokenizerMismatchError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}; "
            "pass the tokenizer the model was trained with (--tokenizer_name_or_path) or train a new model"
        )
