"""Run an ablation matrix of training jobs and write its report (the same command as `kimi-k3-ablate`).

    python scripts/ablate.py --preset quick
    python scripts/ablate.py --preset full --output_dir ablations/full
    python scripts/ablate.py --list
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing

from kimi_k3.ablation.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
