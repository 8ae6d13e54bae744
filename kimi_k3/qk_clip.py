"""QK-Clip for Kimi K3's MLA layers (training.md §2.5): keep every head's max attention logit at or below tau.

The model records nothing: :class:`LogitMaxRecorder`, which ``QKClip`` attaches to every MLA layer's
``query_key_observer``, keeps each head's running max S_h of the pre-softmax logits over the training forwards of a step.
After an optimizer step, a head with S_h > tau gets gamma_h = tau / S_h, and

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

from .padding import PaddingTracker


class LogitMaxRecorder:
    """Per-head running max [H] of one MLA layer's pre-softmax logits over the pairs attention uses (causal, query and
    key both real tokens of one packed document), from training forwards with gradients: a padded query row is never
    attended from, nor a key of another document, so neither must trigger a clip. Attached as the layer's
    ``query_key_observer``."""

    def __init__(self, attn, padding: PaddingTracker):
        self.padding = padding
        self.maximum = torch.full((attn.num_heads,), float("-inf"), device=attn.kv_b_proj.weight.device)
        attn.query_key_observer = self

    def __call__(self, attn, queries: torch.Tensor, keys: torch.Tensor) -> None:
        if attn.training and torch.is_grad_enabled():
            with torch.no_grad():
                self._add(attn, queries, keys)

    def _add(self, attn, queries: torch.Tensor, keys: torch.Tensor) -> None:
        dtype = torch.promote_types(queries.dtype, torch.float32)  # at least fp32; fp64 references stay exact
        logits = torch.matmul(queries.to(dtype), keys.to(dtype).transpose(2, 3)) * attn.scaling
        batch, _, query_len, key_len = logits.shape
        allowed = torch.ones(query_len, key_len, dtype=torch.bool, device=logits.device).tril(key_len - query_len)
        allowed = allowed.expand(batch, 1, -1, -1)
        token_mask = self.padding.rows(batch * query_len)
        if token_mask is not None:
            valid = token_mask.view(batch, -1)
            allowed = allowed & valid[:, None, -query_len:, None] & valid[:, None, None, -key_len:]
        if self.padding.document_starts is not None:  # packed documents never continue a cache: keys = queries
            document = self.padding.document_starts.cumsum(-1)
            allowed = allowed & (document[:, None, :, None] == document[:, None, None, :])
        head_max = logits.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
        self.maximum = torch.maximum(self.maximum.to(head_max.device), head_max)


class QKClip:
    """Clips the MLA layers of ``model`` with threshold ``tau``; call it once after every optimizer step."""

    def __init__(self, model, tau):
        config = model.config
        check_tau(tau)
        distributed = getattr(config, "distributed_config", None)  # set by from_pretrained(distributed_config=...)
        if distributed is not None and distributed.tp_size > 1:
            raise ValueError(
                "QK-Clip does not run on a tensor-parallel model: each rank computes the logits of its own MLA heads, "
                "while the recorded maxima and the clip address every head."
            )
        self.tau = float(tau)
        self.layers = [module for module in model.modules() if hasattr(module, "query_key_observer")]
        if not self.layers:
            raise ValueError(f"QK-Clip found no MLA layer (a module with `query_key_observer`) in {type(model).__name__}.")
        padding = PaddingTracker(model)
        self.recorders = [LogitMaxRecorder(attn, padding) for attn in self.layers]
        self.nope = config.qk_nope_head_dim
        self.num_heads = config.num_attention_heads

        self.latest_metrics: dict[str, float] = {}

    @torch.no_grad()
    def __call__(self):
        maxima = self._pooled_logit_max()
        gammas = clip_factors(maxima, self.tau)
        for attn, recorder, gamma in zip(self.layers, self.recorders, gammas):
            self._rescale_heads(attn, gamma)
            recorder.maximum.fill_(-torch.inf)
        self.latest_metrics = clip_metrics(maxima, self.tau)

    def _pooled_logit_max(self):
        """Max [layers, heads] over every forward of the step and, under torch.distributed, over ranks."""
        maxima = torch.stack([recorder.maximum for recorder in self.recorders])
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


def check_tau(tau) -> None:
    """A threshold QK-Clip can use: a finite or infinite number > 0 (NaN, 0 and negatives are refused)."""
    if not (isinstance(tau, (int, float)) and tau > 0):
        raise ValueError(f"`qk_clip_tau` must be a number > 0 (K2 used 100), got {tau!r}.")


def clip_metrics(logit_max, tau) -> dict[str, float]:
    """Statistics of one clip over the pooled per-head maxima [layers, heads]; empty when nothing was recorded.

    ``max_logit_after`` is the largest max logit the same inputs give after the clip: a clipped head lands on tau.
    """
    recorded = logit_max[logit_max > -torch.inf]
    if recorded.numel() == 0:
        return {}
    max_logit = recorded.max().item()
    return {
        "qk_clip/clipped_heads": int((recorded > tau).sum()),
        "qk_clip/max_logit": max_logit,
        "qk_clip/max_logit_after": min(max_logit, tau),
    }


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
    """QK-Clip statistics in the Trainer's logs, and the clip itself when the optimizer does not clip.

    With :class:`~kimi_k3.muon.PerHeadMuon` built with ``qk_clip_tau`` the optimizer clips inside its own step and this
    callback only reports it (``tau`` may then be omitted); with any other optimizer (e.g. the AdamW baseline) it
    clips with ``tau`` after every optimizer step. The latest step's ``qk_clip/clipped_heads``, ``qk_clip/max_logit``
    and ``qk_clip/max_logit_after`` join every training-loss log, like the load-balance metrics.
    """

    def __init__(self, tau=None):
        if tau is not None:
            check_tau(tau)
        self.tau = tau
        self.clip = None
        self.clips_here = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        own = getattr(_unwrapped(optimizer), "qk_clip", None)
        if own is not None:
            if self.tau is not None and self.tau != own.tau:
                raise ValueError(f"QKClipCallback(tau={self.tau}) but the optimizer already clips with tau={own.tau}.")
            self.clip, self.clips_here = own, False
        elif self.tau is None:
            raise ValueError("QKClipCallback needs `tau` when the optimizer does not clip (no `qk_clip` on it).")
        else:
            self.clip, self.clips_here = QKClip(model, self.tau), True

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.clips_here:
            self.clip()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and self.clip is not None and self.clip.latest_metrics:
            logs.update(self.clip.latest_metrics)
            state.log_history[-1].update(self.clip.latest_metrics)


def _unwrapped(optimizer):
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)
