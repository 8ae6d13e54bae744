"""QK-Clip for Kimi K3's MLA layers (MuonClip of the Kimi K2 report, arXiv:2507.20534, which K3 keeps): keep every head's max attention logit at or below tau.

The model records nothing: :class:`LogitMaxRecorder`, which ``QKClip.attach`` sets as every MLA layer's
``query_key_observer``, keeps each head's running max S_h of the pre-softmax logits over the training forwards of a step.
After each step of the optimizer it is attached to (a step hook, so any optimizer and any training loop), a head with
S_h > tau gets gamma_h = tau / S_h, and

- its q_b_proj nope rows and kv_b_proj k_nope rows are multiplied by sqrt(gamma_h) (nope logit scales by gamma_h),
- its q_b_proj rope rows by gamma_h (the shared k_r of kv_a_proj_with_mqa is untouched, so that logit scales by
  gamma_h too),

so the same input gives a max logit of exactly tau. V rows are untouched. KDA needs no clip: its q and k are
L2-normalized.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.attachments.padding import PaddingTracker, shared_padding
from kimi_k3.attachments.seams import find_mla_layers
from kimi_k3.policies.callback import PolicyCallback


class LogitMaxRecorder:
    """Per-head running max [H] of one MLA layer's pre-softmax logits over the pairs attention uses (causal, query and
    key both real tokens of one packed document), from training forwards with gradients: a padded query row is never
    attended from, nor a key of another document, so neither must trigger a clip. The layer's ``query_key_observer``
    while QK-Clip is attached. ``training_only=False`` records every forward (a measurement of a trained model)."""

    def __init__(self, attn, padding: PaddingTracker, training_only: bool = True):
        self.padding, self.training_only = padding, training_only
        self.maximum = torch.full((attn.num_heads,), float("-inf"), device=attn.kv_b_proj.weight.device)

    def __call__(self, attn, queries: torch.Tensor, keys: torch.Tensor) -> None:
        if not self.training_only or (attn.training and torch.is_grad_enabled()):
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
    """QK-Clip of the MLA layers of ``model`` with threshold ``tau``.

    ``attach(optimizer)`` records from then on and clips after every step of ``optimizer``; ``attach()`` only
    records, and calling the ``QKClip`` clips once. ``latest_metrics`` holds the last clip's statistics.
    """

    def __init__(self, model, tau):
        config = model.config
        check_tau(tau)
        distributed = getattr(config, "distributed_config", None)  # set by from_pretrained(distributed_config=...)
        if distributed is not None and distributed.tp_size > 1:
            raise ValueError(
                "QK-Clip does not run on a tensor-parallel model: each rank computes the logits of its own MLA heads, "
                "while the recorded maxima and the clip address every head."
            )
        if not find_mla_layers(model):
            raise ValueError(f"QK-Clip found no MLA layer (a module with `query_key_observer`) in {type(model).__name__}.")
        self.model = model
        self.tau = float(tau)
        self.nope = config.qk_nope_head_dim
        self.num_heads = config.num_attention_heads
        self.recorders: dict[str, tuple[torch.nn.Module, LogitMaxRecorder]] = {}
        self.latest_metrics: dict[str, float] = {}

    def attach(self, optimizer=None, model=None) -> Attachment:
        """Record every MLA layer's logits (of ``model``, default the one given at construction) and, with an
        ``optimizer``, clip after each of its steps; the handle's ``remove()`` undoes both."""
        model = self.model if model is None else model
        if self.recorders:
            raise ValueError("this QK-Clip is already attached; remove that attachment first")
        attachment = Attachment("QK-Clip")
        with undone_on_failure(attachment):
            attachment.add(self.recorders.clear)
            padding = shared_padding(model, attachment)
            for name, attn in find_mla_layers(model).items():
                recorder = LogitMaxRecorder(attn, padding)
                attachment.set_attribute(attn, "query_key_observer", recorder)
                self.recorders[name] = (attn, recorder)
            if optimizer is not None:
                attachment.run_after_each_step(optimizer, self)
        return attachment

    @torch.no_grad()
    def __call__(self):
        if not self.recorders:
            raise RuntimeError("QK-Clip clips what it recorded: attach it first (QKClip.attach)")
        maxima = self._pooled_logit_max()
        gammas = clip_factors(maxima, self.tau)
        for (attn, recorder), gamma in zip(self.recorders.values(), gammas):
            self._rescale_heads(attn, gamma)
            recorder.maximum.fill_(-torch.inf)
        self.latest_metrics = clip_metrics(maxima, self.tau)

    def _pooled_logit_max(self):
        """Max [layers, heads] over every forward of the step and, under torch.distributed, over ranks."""
        maxima = torch.stack([recorder.maximum for _, recorder in self.recorders.values()])
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


class QKClipCallback(PolicyCallback):
    """QK-Clip with threshold ``tau`` under ``Trainer``, with any optimizer: attached to the Trainer's model and
    optimizer for the run (the clip runs from the optimizer's step hook), its latest ``qk_clip/clipped_heads``,
    ``qk_clip/max_logit`` and ``qk_clip/max_logit_after`` added to every training-loss log, like the load-balance
    metrics."""

    def __init__(self, tau):
        check_tau(tau)
        super().__init__()
        self.tau = tau

    def policy_for(self, model) -> QKClip:
        return QKClip(model, self.tau)
