"""Publish a saved Kimi K3 folder to the Hugging Face Hub with our model card.

    python scripts/push_to_hub.py outputs/kimi-k3-small/model --repo_id you/kimi-k3-small
    python scripts/push_to_hub.py outputs/kimi-k3-small/checkpoint-150 --repo_id you/kimi-k3-small --private

Uploads code, config, weights and tokenizer with HfApi.create_repo + upload_folder, never Trainer state (optimizer,
scheduler, RNG). A folder without a README.md (e.g. checkpoint-N) first gets our card, with the architecture and
parameter counts; the token comes from --token, HF_TOKEN or `hf auth login`.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing

from kimi_k3 import hub  # noqa: E402
from kimi_k3.model_card import card_for_folder  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="saved model folder (output_dir/model or a checkpoint-N folder)")
    parser.add_argument("--repo_id", required=True, help="hub repository, e.g. you/kimi-k3-small")
    parser.add_argument("--token", default=None, help="hub token (default: HF_TOKEN or the stored login)")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--commit_message", default="Upload Kimi K3 model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        api = hub.HfApi(token=hub.resolve_token(args.token))
        hub.check_model_files(args.folder)
        readme = args.folder / "README.md"
        if not readme.exists():
            card_for_folder(args.folder, args.repo_id).save(readme)
            print(f"wrote a model card to {readme}")
        repo_id = hub.push_folder(
            args.folder, args.repo_id, api, private=args.private, commit_message=args.commit_message
        )
    except ValueError as error:
        print(f"push_to_hub: error: {error}", file=sys.stderr)
        return 2
    print(f"pushed {args.folder} to {repo_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
