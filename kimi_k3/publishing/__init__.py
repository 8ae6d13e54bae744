"""Model cards and hub uploads of saved model folders, and the ``kimi-k3-push`` command."""
