"""Convert a Kimi-K3 checkpoint between our save_pretrained layout and the released layout: ``kimi-k3-convert``.

    kimi-k3-convert to-release   OUR_FOLDER      RELEASED_FOLDER [--max_shard_size 5GB]
    kimi-k3-convert from-release RELEASED_FOLDER OUR_FOLDER      [--max_shard_size 5GB]

``to-release`` writes the multimodal wrapper config, ``language_model.``-prefixed text tensors, MXFP4 routed experts
and zero-padded ``A_log``; ``from-release`` undoes all four and drops the vision tower. Both stream one output shard
at a time and write ``model.safetensors.index.json`` when there is more than one shard.
"""

import argparse
import sys
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers.utils.hub import convert_file_size_to_int

from kimi_k3.checkpoint import run_folder
from kimi_k3.checkpoint.release_format import DEFAULT_MAX_SHARD_BYTES, export_released, import_released

PROG = "kimi-k3-convert"
DIRECTIONS = {"to-release": export_released, "from-release": import_released}


def parse_size(text: str) -> int:
    """'5GB', '500MiB' or a plain byte count -> bytes, spelled as ``save_pretrained(max_shard_size=...)`` takes it."""
    try:
        return int(text) if text.strip().isdigit() else convert_file_size_to_int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--max_shard_size must be a whole number of bytes or one followed by a unit (KB, MB, GB, KiB, MiB, GiB), "
            f"got {text!r}."
        ) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=sorted(DIRECTIONS))
    parser.add_argument("source", type=Path, help="checkpoint folder to read")
    parser.add_argument("target", type=Path, help="empty or new folder to write")
    parser.add_argument(
        "--max_shard_size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES, help="largest output shard (default 5GiB)"
    )
    parser.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert; a bad input or a failed write prints one line and returns 2, leaving no partial target folder."""
    args = parse_args(argv)
    convert = DIRECTIONS[args.direction]
    try:
        shards = convert(args.source, args.target, max_shard_bytes=args.max_shard_size, progress=not args.no_progress)
    except (ValueError, OSError, SafetensorError) as error:  # safetensors reports a failed write as its own error
        cause = run_folder.write_failure_cause(error)
        prefix = f"writing {args.target} failed{cause}, nothing partial was left: " if cause else ""
        print(f"{PROG}: error: {prefix}{' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except StrictDataclassError as error:  # the folder's config.json: the error's cause is one line naming the field
        print(f"{PROG}: error: {args.source}/config.json: {error.__cause__ or error}", file=sys.stderr)
        return 2
    print(f"Wrote {len(shards)} shard(s) to {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
