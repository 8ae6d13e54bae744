"""The ``kimi-k3-train`` job (`kimi_k3.job.main`): pre-train or fine-tune a Kimi K3 model with ``transformers.Trainer``.

Its parts: `arguments` (options and checks), `trainer` (the Trainer subclass), `final_save` (the final folder, card and
report), and the callbacks whose records span a resumed run (`resumable`, `expert_load`).
"""
