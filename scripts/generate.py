"""Print a continuation of a prompt from any saved Kimi K3 folder or hub repo.

    python scripts/generate.py outputs/kimi-k3-small/model --trust_remote_code --prompt "The with statement"

Only transformers is used: the model and configuration code come from the folder itself, and run only with
--trust_remote_code (read them first when the folder is not your own). A name that names no folder here is looked up
on the hub only with --from_hub: a mistyped local path (``outptus/kimi-k3-small``) reads as a hub repository id, whose
code would then run. A local folder's files are checked (regular files inside it, bounded sizes) before any is read.
"""

import argparse
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoModelForCausalLM, AutoTokenizer

from loading_kimi_k3 import (
    MAX_JSON_FILE_BYTES,
    TOKENIZER_FILES,
    check_local_folder,
    checked_regular_file,
    folder_root,
)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="saved model folder or hub repo id")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="run the Python files the folder or repo ships (its model code); needed for Kimi K3")
    parser.add_argument("--from_hub", action="store_true",
                        help="MODEL is a hub repository id (a name that is no local folder is refused otherwise)")
    parser.add_argument("--prompt", default="The with statement")
    parser.add_argument("--max_new_tokens", type=int, default=60)
    parser.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    return parser, parser.parse_args(argv)


def missing_local_path(name: str, from_hub: bool = False) -> str | None:
    """Why ``name`` cannot be loaded as asked, or None: a local folder, or with ``from_hub`` a valid hub repository id
    (``NAME`` or ``OWNER/NAME``, the hub's rules) that names no local folder."""
    path = Path(name).expanduser()
    if path.is_dir():
        return None
    if path.exists():
        return f"{name} is a file, not a model folder"
    try:
        validate_repo_id(name)
    except HFValidationError:
        return f"no such folder: {name} (a local path is never looked up on the hub)"
    if "/" in name and Path(Path(name).parts[0]).is_dir():
        return f"no such folder: {name} (a local path is never looked up on the hub)"
    if not from_hub:
        return f"no such folder: {name}; to load the hub repository of that name, pass --from_hub"
    return None


def check_local_files(name: str) -> None:
    """A local folder's configuration, weights and tokenizer files, checked before transformers opens them."""
    if Path(name).expanduser().is_dir():
        folder = Path(name).expanduser()
        check_local_folder(folder)
        for path in folder.iterdir():
            if path.name in TOKENIZER_FILES or path.name.startswith("tokenizer"):
                checked_regular_file(path, folder_root(folder), MAX_JSON_FILE_BYTES)


def load(name: str, trust_remote_code: bool):
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as error:  # json, tokenizers and transformers each report a malformed file in their own class
        if "trust_remote_code" in str(error):
            raise
        raise ValueError(f"{name}: its tokenizer files cannot be read (malformed tokenizer.json?): {error}") from None
    model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=trust_remote_code).eval()
    return tokenizer, model


def continuation(model, tokenizer, prompt: str, **generate_kwargs) -> str:
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    output = model.generate(**inputs, **generate_kwargs)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def check_length(parser: argparse.ArgumentParser, model, tokenizer, prompt: str, max_new_tokens: int) -> None:
    """Checked before generating: past the position limit generation would fail after its last token."""
    limit = getattr(model.config, "max_position_embeddings", None)
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    if max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        parser.error(
            f"--max_new_tokens {max_new_tokens} plus the prompt's {prompt_tokens} tokens exceeds the model's "
            f"max_position_embeddings ({limit}); pass --max_new_tokens {max(limit - prompt_tokens, 0)} or less"
        )


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    problem = missing_local_path(args.model, args.from_hub)
    if problem is not None:
        parser.error(problem)
    try:
        check_local_files(args.model)
        tokenizer, model = load(args.model, args.trust_remote_code)
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            parser.error(" ".join(str(error).split()))
        parser.error(f"{args.model} ships its own model code: read it, then pass --trust_remote_code to run it")
    check_length(parser, model, tokenizer, args.prompt, args.max_new_tokens)
    decoding = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k} if args.do_sample else {
        "do_sample": False
    }
    torch.manual_seed(args.seed)
    print(continuation(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, **decoding))


if __name__ == "__main__":
    main()
