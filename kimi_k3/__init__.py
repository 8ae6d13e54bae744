"""Training-side library for Kimi K3 models, by concern:

- ``attachments``: how training code acts on a model from outside (the model's seams, the shared padding mask,
  removable handles);
- ``policies``: Quantile Balancing and QK-Clip, which update from optimizer step hooks, and their Trainer callbacks;
- ``optim``: Per-Head Muon, its split Newton–Schulz, and the precision it picks;
- ``kernels``: compiled kernels attached to the model (fused SiTU-GLU);
- ``quantization``: MXFP4 quantization-aware training of the routed experts;
- ``checkpoint``: the released layout's folder conversion and atomic folder writes;
- ``parallel``, ``planning``: FSDP2 sharding helpers; per-rank memory and communication plans;
- ``text``: training corpora and tokenizers; ``publishing``: model cards and hub uploads;
- ``job``: the ``kimi-k3-train`` training job;
- ``ablation``: the lab, a matrix of training jobs that each change one K3 choice (``kimi-k3-ablate``).

They import one another in one direction only, the lab on top (the layers are declared once, in
``tests/test_repository.py``).

The model itself lives in flat modules at the repository root (``configuration_kimi_k3``, ``modeling_kimi_k3`` and
the files it imports: ``kda_kimi_k3``, ``packing_kimi_k3``, ``checkpoint_format_kimi_k3``, ``loading_kimi_k3``) so
that the very same files can be copied into checkpoint folders for ``trust_remote_code``; ``variants_kimi_k3``
subclasses them for the opt-in Stable LatentMoE variants.
"""

# Importing the configuration warns, once per process, where the installed transformers lies outside the tested
# range: a user's `pip install -U transformers` must not stop every command with a traceback.
import configuration_kimi_k3  # noqa: F401
