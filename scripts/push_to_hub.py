"""Publish a saved Kimi K3 folder to the Hugging Face Hub with our model card (the same as the `kimi-k3-push` command).

    python scripts/push_to_hub.py outputs/kimi-k3-small/model --hub_model_id you/kimi-k3-small
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing

from kimi_k3.publishing.push import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
