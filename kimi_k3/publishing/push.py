"""Publish a saved Kimi K3 folder to the Hugging Face Hub with our model card: ``kimi-k3-push``.

    kimi-k3-push outputs/kimi-k3-small/model --hub_model_id you/kimi-k3-small
    kimi-k3-push outputs/kimi-k3-small/checkpoint-150 --hub_model_id you/kimi-k3-small --hub_private_repo
    kimi-k3-push outputs/kimi-k3-small/model --hub_model_id someone/kimi-k3-small --create_pr
    kimi-k3-push outputs/kimi-k3-small/model --hub_model_id you/kimi-k3-small --hub_revision lr-3e-3

Uploads code, config, weights, tokenizer and the card's picture with HfApi.create_repo + create_commit, never Trainer
state (optimizer, scheduler, RNG). A folder without a README.md (e.g. checkpoint-N) first gets our card, with the
architecture and parameter counts; our card is published under --hub_model_id (its name, title and usage snippet),
and --license sets its license either way. The token comes from --hub_token, HF_TOKEN or `hf auth login`. The hub
options are spelled as the training job's (``TrainingArguments``'). A failure (no token, a rejected token, no
connection) ends with one line naming the cause and the fix, exit status 2.
"""

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from kimi_k3.publishing import hub
from kimi_k3.publishing.model_card import (
    card_for_folder,
    is_our_card,
    license_metadata,
    name_card_for_repo,
    set_license,
)

PROG = "kimi-k3-push"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="saved model folder (output_dir/model or a checkpoint-N folder)")
    parser.add_argument("--hub_model_id", required=True, help="hub repository, e.g. you/kimi-k3-small")
    parser.add_argument("--hub_token", default=None, help="hub token (default: HF_TOKEN or the stored login)")
    parser.add_argument("--hub_private_repo", action="store_true", help="create the repository as private")
    parser.add_argument("--hub_revision", default=None,
                        help="branch to push to, created from the default branch if missing (default: main)")
    parser.add_argument("--create_pr", action="store_true",
                        help="open a pull request (against --hub_revision, else main) instead of committing")
    parser.add_argument("--commit_message", default="Upload Kimi K3 model")
    parser.add_argument("--license", default=None,
                        help="set the card's license: a hub identifier (apache-2.0, mit, ...) or `other` with "
                             "--license_name and --license_link (default: keep the card's)")
    parser.add_argument("--license_name", default=None, help="name of a custom license (--license other)")
    parser.add_argument("--license_link", default=None, help="URL of a custom license's text (--license other)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for the hub to connect and for each read or write (default: 60)")
    return parser.parse_args(argv)


def prepare_card(readme: Path, repo_id: str, license_fields: dict) -> None:
    """Our card, named for ``repo_id``: written for a folder without one, renamed (and relicensed) if ours."""
    if not readme.exists():
        card_for_folder(readme.parent, repo_id, license_fields).save(readme)
        print(f"wrote a model card to {readme}")
    elif is_our_card(readme):
        name_card_for_repo(readme, repo_id)
        if license_fields:
            set_license(readme, license_fields)
            print(f"set the license of {readme} to {license_fields['license']}")


@contextmanager
def restored_on_failure(path: Path):
    """A failed push leaves ``path`` as it was: the card keeps naming the repository it was last published to."""
    before = path.read_bytes() if path.exists() else None
    try:
        yield
    except BaseException:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(before)
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        license_fields = license_metadata(args.license, args.license_name, args.license_link)
        hub.check_online()
        api = hub.HfApi(token=hub.resolve_token(args.hub_token))
        hub.check_model_files(args.folder)
        readme = args.folder / "README.md"
        with restored_on_failure(readme):
            prepare_card(readme, args.hub_model_id, license_fields)
            pushed = hub.push_folder(
                args.folder, args.hub_model_id, api, private=args.hub_private_repo,
                commit_message=args.commit_message, revision=args.hub_revision, create_pr=args.create_pr,
                timeout=args.timeout,
            )  # fmt: skip
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except StrictDataclassError as error:  # the folder's config.json: the error's cause is one line naming the field
        print(f"{PROG}: error: {args.folder}/config.json: {error.__cause__ or error}", file=sys.stderr)
        return 2
    print(f"pushed {args.folder} to {pushed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
