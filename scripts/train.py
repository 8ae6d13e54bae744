"""Pre-train or fine-tune a Kimi K3 model with transformers.Trainer (the same job as the `kimi-k3-train` command).

    python scripts/train.py                                   # default model, embedded corpus, a few CPU minutes
    python scripts/train.py --data_files my.txt --max_steps 500 --output_dir runs/mine
    python scripts/train.py --model_name_or_path outputs/kimi-k3-small/model --data_files notes.jsonl
    python scripts/train.py --output_dir outputs/kimi-k3-small --resume_from_checkpoint True
    python scripts/train.py --help                            # every TrainingArguments option is accepted
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing

from kimi_k3.job.command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
