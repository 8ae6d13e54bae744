"""Whole-folder conversion between this project's layout and the released Kimi-K3 layout, and folder writes that
publish atomically. The formats themselves ship with the model in ``checkpoint_format_kimi_k3.py``."""
