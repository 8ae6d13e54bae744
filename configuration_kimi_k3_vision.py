"""Configuration of Kimi K3's vision side: the MoonViT3d tower and the patch-merger projector.

Field names and defaults are those of the released checkpoint's ``vision_config`` (``moonshotai/Kimi-K3``): a
1024-wide tower of 27 blocks with 12 heads of 128 (q/k/v width 1536, wider than the residual), RMSNorm and no biases,
a learnable 64 x 64 position table resized bilinearly to each image's patch grid, and a projector that concatenates
each 2 x 2 group of patch vectors into one language-model token (post-RMSNorm, no biases). ``KimiK3Config`` holds one
as ``vision_config`` when the model sees; the text-only model has none.
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

# The one layout of each kind the release uses; other values of these fields belong to other MoonViT releases.
SUPPORTED_LAYOUTS = {
    "pos_emb_type": ("divided_fixed",),
    "merge_type": ("sd2_tpool",),
    "mm_projector_type": ("patchmergerv2",),
    "norm_type": ("rmsnorm",),
    "mlp_type": ("mlp2",),
}
INTERPOLATION_MODES = ("bilinear", "bicubic", "nearest")


@strict(accept_kwargs=True)
class KimiK3VisionConfig(PreTrainedConfig):
    r"""
    Configuration of [`KimiK3ForConditionalGeneration`]'s vision tower (MoonViT3d) and projector (patch merger v2).

    The ``vt_*`` fields size the tower; ``text_hidden_size`` is the language model's width, which the projector
    writes; ``media_placeholder_token_id`` is the token each image replaces in ``input_ids``; labels at image tokens
    are ``ignore_index``.
    """

    model_type = "kimi_k3_vision"
    base_config_key = "vision_config"

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    merge_kernel_size: tuple[int, int] | list[int] = (2, 2)
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int | None = None
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    ignore_index: int = -100
    media_placeholder_token_id: int = 163605
    pad_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        if self.mm_hidden_size is None:
            self.mm_hidden_size = self.vt_hidden_size
        self.merge_kernel_size = tuple(self.merge_kernel_size)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Refuse, naming the field, a layout this implementation does not build."""
        for name, allowed in SUPPORTED_LAYOUTS.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"vision_config.{name}={getattr(self, name)!r} is not supported; allowed: {allowed}")
        if self.pos_emb_interpolation_mode not in INTERPOLATION_MODES:
            raise ValueError(
                f"vision_config.pos_emb_interpolation_mode={self.pos_emb_interpolation_mode!r}; allowed: "
                f"{INTERPOLATION_MODES}"
            )
        if self.qkv_hidden_size % self.vt_num_attention_heads or (self.qkv_hidden_size // self.vt_num_attention_heads) % 4:
            raise ValueError(
                f"vision_config.qkv_hidden_size={self.qkv_hidden_size} must split into vt_num_attention_heads="
                f"{self.vt_num_attention_heads} heads whose size is a multiple of 4 (2-D rotary pairs for x and y)"
            )
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) < 1:
            raise ValueError(f"vision_config.merge_kernel_size={self.merge_kernel_size!r}: two positive integers")
        if self.mm_hidden_size != self.vt_hidden_size:
            raise ValueError(
                f"vision_config.mm_hidden_size={self.mm_hidden_size} must equal vt_hidden_size={self.vt_hidden_size}: "
                "the projector reads the tower's output"
            )

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def tokens_per_merge(self) -> int:
        """Patches that become one language-model token (2 x 2 in the release)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def tiny(cls, text_hidden_size: int, **overrides) -> "KimiK3VisionConfig":
        """A few-layer tower of the released shape ratios for tests and CPU runs (8 x 8 position table, so images
        other than 112 x 112 pixels exercise the interpolation)."""
        values = dict(
            init_pos_emb_height=8, init_pos_emb_width=8, vt_num_attention_heads=2, vt_num_hidden_layers=2,
            vt_hidden_size=64, qkv_hidden_size=96, vt_intermediate_size=128, text_hidden_size=text_hidden_size,
        )  # fmt: skip
        values.update(overrides)
        return cls(**values)


__all__ = ["KimiK3VisionConfig"]
