"""The ``kimi-k3-train`` job: pre-train or fine-tune a Kimi K3 model with ``transformers.Trainer``."""

from kimi_k3.job.main import main

__all__ = ["main"]
