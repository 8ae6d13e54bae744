"""Convert a Kimi-K3 checkpoint between our layout and the released one (the same as the `kimi-k3-convert` command).

    python scripts/convert_checkpoint.py to-release   our-folder      released-folder --max_shard_size 2GB
    python scripts/convert_checkpoint.py from-release released-folder our-folder
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing

from kimi_k3.checkpoint.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
