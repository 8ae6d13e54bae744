"""The training kernels `kimi-k3-train` attaches to the model it trains, as one removable attachment."""

from torch import nn

from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.kernels.fused_attention_residual import use_fused_attention_residuals
from kimi_k3.kernels.fused_situ import use_fused_situ
from kimi_k3.kernels.sorted_experts import use_sorted_experts


def use_fused_kernels(model: nn.Module, situ: bool = True, attention_residuals: bool = True,
                      experts: bool = True) -> Attachment:
    """Fused SiTU-GLU (`use_fused_situ`), fused Block AttnRes (`use_fused_attention_residuals`) and the routed experts'
    gathers (`use_sorted_experts`), each unless turned off; ``remove()`` on the returned handle takes off all three."""
    attachment = Attachment("fused kernels")
    with undone_on_failure(attachment):
        if situ:
            attachment.add(use_fused_situ(model))
        if attention_residuals:
            attachment.add(use_fused_attention_residuals(model))
        if experts:
            attachment.add(use_sorted_experts(model))
    return attachment
