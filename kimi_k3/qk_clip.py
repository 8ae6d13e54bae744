"""QK-Clip for Kimi K3's MLA layers (training.md §2.5): keep every head's max attention logit at or below tau.

The model only records the statistic (``self_attn.attn_logit_max``, a per-head running max of the pre-softmax logits,
written in training forwards when ``config.record_attn_logit_max`` is True); the policy lives here. After an optimizer step,
a head with recorded max S_h > tau gets gamma_h = tau / S_h, and

- its q_b_proj nope rows and kv_b_proj k_nope rows are multiplied by sqrt(gamma_h) (nope logit scales by gamma_h),
- its q_b_proj rope rows by gamma_h (the shared k_r of kv_a_proj_with_mqa is untouched, so that logit scales by
  gamma_h too),

so the same input gives a max logit of exactly tau. V rows are untouched. KDA needs no clip: its q and k are
L2-normalized.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from transformers import TrainerCallback


class QKClip:
    """Clips the MLA layers of ``model`` with threshold ``tau``; call it once after every optimizer step."""

    def __init__(self, model, tau):
        config = model.config
        if not tau > 0:
            raise ValueError(f"`qk_clip_tau` must be > 0, got {tau!r}.")
        if not getattr(config, "record_attn_logit_max", False):
            raise ValueError(
                "QK-Clip needs the recorded per-head max logits: build the model with "
                "`config.record_attn_logit_max=True`."
            )
        self.tau = float(tau)
        self.layers = [module for module in model.modules() if hasattr(module, "attn_logit_max")]
        if not self.layers:
            raise ValueError(f"QK-Clip found no MLA layer (a module with `attn_logit_max`) in {type(model).__name__}.")
        self.nope = config.qk_nope_head_dim
        self.num_heads = config.num_attention_heads

    @torch.no_grad()
    def __call__(self):
        gammas = clip_factors(self._pooled_logit_max(), self.tau)
        for attn, gamma in zip(self.layers, gammas):
            self._rescale_heads(attn, gamma)
            attn.attn_logit_max.fill_(-torch.inf)

    def _pooled_logit_max(self):
        """Max over every forward of the step and, under torch.distributed, over ranks.

        Under DDP train with ``ddp_broadcast_buffers=False`` (hf-integration.md §3.3): the buffer broadcast copies
        rank 0's running max over every rank's at each forward, losing the other ranks' earlier micro-batches.
        """
        maxima = torch.stack([attn.attn_logit_max for attn in self.layers])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        return maxima

    def _rescale_heads(self, attn, gamma):
        root = gamma.sqrt()
        query, key_value = _query_up_proj(attn).weight, attn.kv_b_proj.weight
        _scale_rows(query, self._row_scales(query, root, gamma))
        _scale_rows(key_value, self._row_scales(key_value, root, torch.ones_like(gamma)))

    def _row_scales(self, weight, nope_scale, rest_scale):
        """Per-row factors [rows, 1] of a per-head projection: ``nope_scale[h]`` on head h's first ``nope`` rows,
        ``rest_scale[h]`` on its others (rope rows of q_b_proj, V rows of kv_b_proj)."""
        rest = weight.shape[0] // self.num_heads - self.nope
        per_head = torch.cat([nope_scale[:, None].expand(-1, self.nope), rest_scale[:, None].expand(-1, rest)], 1)
        return per_head.reshape(-1, 1)


def clip_factors(logit_max, tau):
    """gamma = tau / S where S > tau, exactly 1 elsewhere (so unclipped heads stay bitwise unchanged)."""
    return torch.where(logit_max > tau, tau / logit_max, torch.ones_like(logit_max))


def _scale_rows(weight, scale):
    """``weight *= scale`` in place, for a plain weight or an FSDP2 (``DTensor``) shard of one.

    The product promotes to the fp32 scale and rounds once into the weight dtype, and a factor of exactly 1 keeps a
    row bitwise. A sharded weight takes the column as a replicated ``DTensor``: every rank scales its own rows.
    """
    if isinstance(weight, DTensor):
        placements = [Replicate()] * weight.device_mesh.ndim
        scale = DTensor.from_local(scale, weight.device_mesh, placements, run_check=False)
    weight.mul_(scale)


def _query_up_proj(attn):
    # Without a query LoRA (q_lora_rank=None) MLA projects queries with q_proj, laid out per head the same way.
    return attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj


class QKClipCallback(TrainerCallback):
    """QK-Clip for a Trainer whose optimizer is not :class:`~kimi_k3.muon.PerHeadMuon` (e.g. the AdamW baseline).

    ``PerHeadMuon.for_model(..., qk_clip_tau=tau)`` clips inside its own step. Using both is harmless, not useful:
    the first clip resets the recorded maxima.
    """

    def __init__(self, tau):
        self.tau = tau
        self.clip = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.clip = QKClip(model, self.tau)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.clip()
