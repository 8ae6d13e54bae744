"""PyTorch Kimi K3 vision-language model: the MoonViT3d tower, the patch-merger projector, and the text model.

The file reads top-down like the released wrapper (``moonshotai/Kimi-K3``, ``KimiK3ForConditionalGeneration``):
patch embedding with its interpolated 2-D position table and fixed time embedding, the 2-D rotary embedding, the
encoder block with per-image bidirectional attention, the tower with its 2 x 2 temporal-pooling merge, the projector,
the merge of image tokens into the text embeddings, and the model, which runs ``KimiK3ForCausalLM`` unchanged.
Attribute names are the released checkpoint's state-dict names (``vision_tower.*``, ``mm_projector.*``,
``language_model.*``).

References: the Kimi K3 technical report (arXiv:2607.24653), Kimi-VL (arXiv:2504.07491) for MoonViT and its NaViT
packing of native-resolution images, RoFormer (arXiv:2104.09864) and VisionLLaMA (arXiv:2403.00522) for the 2-D
rotary embedding, LLaVA (arXiv:2304.08485) for the merge, and transformers' ``kimi_k25`` and ``llava`` models.

Like the text model's file it imports only torch, transformers and its sibling files, so ``save_pretrained`` copies it
into the folder and it loads with ``trust_remote_code=True``.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple

try:
    from .configuration_kimi_k3 import KimiK3Config
    from .configuration_kimi_k3_vision import KimiK3VisionConfig
    from .modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3PreTrainedModel
except ImportError:
    from configuration_kimi_k3 import KimiK3Config
    from configuration_kimi_k3_vision import KimiK3VisionConfig
    from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3PreTrainedModel

# The release's rotary table: base 10000, precomputed for patch grids of up to 512 x 512.
ROTARY_THETA = 10000.0
ROTARY_MAX_GRID = 512


def image_grids(grid_thws: torch.Tensor) -> list[tuple[int, int, int]]:
    """``grid_thws`` [n_images, 3] (frames, rows, columns of patches) as Python triples."""
    if grid_thws.ndim != 2 or grid_thws.shape[1] != 3:
        raise ValueError(f"grid_thws must be [n_images, 3] (t, h, w in patches), got shape {list(grid_thws.shape)}")
    return [tuple(int(v) for v in row) for row in grid_thws.tolist()]


# ---------------------------------------------------------------------------------------------------------------------
# Patch embedding: Conv2d patches + the 2-D table resized to each grid + a fixed sin-cos row per frame
# ---------------------------------------------------------------------------------------------------------------------
def sincos_time_embedding(dim: int, frames: int, device=None) -> torch.Tensor:
    """[frames, dim]: sin of frame·ω_i in the first half, cos in the second, ω_i = 10000^(−i/(dim/2)) (the fixed
    1-D embedding of MAE/InternVideo, which the release adds per video frame)."""
    omega = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64, device=device) / (dim / 2))
    angles = torch.arange(frames, dtype=torch.float64, device=device)[:, None] * omega
    return torch.cat([angles.sin(), angles.cos()], dim=-1).float()


class KimiK3VisionPositionEmbedding(nn.Module):
    """A learnable [H, W, D] table, resized to each image's (h, w) grid when it differs, plus the time embedding of
    each frame for video (the release's ``divided_fixed`` type)."""

    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.init_pos_emb_height, config.init_pos_emb_width, config.vt_hidden_size)
        )
        self.max_frames = config.init_pos_emb_time
        self.interpolation_mode = config.pos_emb_interpolation_mode

    def grid_table(self, height: int, width: int) -> torch.Tensor:
        """[height·width, D] in row-major order."""
        table = self.weight
        if (height, width) != tuple(table.shape[:2]):
            channels_first = table.permute(2, 0, 1).unsqueeze(0)
            table = F.interpolate(channels_first, size=(height, width), mode=self.interpolation_mode)[0].permute(1, 2, 0)
        return table.reshape(height * width, -1)

    def forward(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        embeddings = []
        for frames, height, width in grids:
            if frames > self.max_frames:
                raise ValueError(
                    f"an input of {frames} frames exceeds vision_config.init_pos_emb_time={self.max_frames}"
                )
            table = self.grid_table(height, width)
            if frames > 1:
                time = sincos_time_embedding(table.shape[-1], frames, table.device).to(table.dtype)
                table = (table.unsqueeze(0) + time.unsqueeze(1)).reshape(frames * height * width, -1)
            embeddings.append(table)
        return torch.cat(embeddings)


class KimiK3VisionPatchEmbed(nn.Module):
    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.patch_size = config.patch_size
        self.proj = nn.Conv2d(
            3, config.vt_hidden_size, config.patch_size, stride=config.patch_size, bias=config.patch_embed_proj_bias
        )
        self.pos_emb = KimiK3VisionPositionEmbedding(config)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``pixel_values`` [L, 3, p, p], one row per patch, images (and frames) one after another."""
        patches = sum(t * h * w for t, h, w in grids)
        expected = (patches, 3, self.patch_size, self.patch_size)
        if tuple(pixel_values.shape) != expected:
            raise ValueError(
                f"pixel_values has shape {list(pixel_values.shape)}; grid_thws asks for {list(expected)} (one "
                "3 x patch_size x patch_size row per patch)"
            )
        return self.proj(pixel_values).view(patches, -1) + self.pos_emb(grids)


# ---------------------------------------------------------------------------------------------------------------------
# 2-D rotary embedding (RoFormer; VisionLLaMA's 2-D form)
# ---------------------------------------------------------------------------------------------------------------------
def vision_rotary_angles(grids: list[tuple[int, int, int]], head_dim: int, device=None) -> torch.Tensor:
    """[L, head_dim/2] rotation angles in fp32: channel pair 2i turns by x·f_i, pair 2i+1 by y·f_i, with
    f_i = θ^(−4i/head_dim), for the patch at (row y, column x); every frame repeats its image's angles."""
    frequencies = 1.0 / ROTARY_THETA ** (torch.arange(0, head_dim, 4, device=device).float() / head_dim)
    angles = []
    for frames, height, width in grids:
        if not (1 <= height <= ROTARY_MAX_GRID and 1 <= width <= ROTARY_MAX_GRID):
            raise ValueError(f"an image grid of {height} x {width} patches exceeds {ROTARY_MAX_GRID} x {ROTARY_MAX_GRID}")
        rows = torch.arange(height, device=device).float().repeat_interleave(width)
        columns = torch.arange(width, device=device).float().repeat(height)
        per_patch = torch.stack([torch.outer(columns, frequencies), torch.outer(rows, frequencies)], dim=-1)
        angles.append(per_patch.reshape(height * width, head_dim // 2).repeat(frames, 1))
    return torch.cat(angles)


def apply_vision_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` [L, heads, head_dim] in fp32, returned in ``x``'s dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imaginary = pairs.unbind(-1)
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    rotated = torch.stack([real * cos - imaginary * sin, real * sin + imaginary * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Encoder block: pre-norm attention (bidirectional within each image) and MLP
# ---------------------------------------------------------------------------------------------------------------------
def same_image_mask(grids: list[tuple[int, int, int]], device=None) -> torch.Tensor | None:
    """[1, 1, L, L] block-diagonal boolean mask of patches that may attend to each other (one image or video clip
    each); None for a single image, which attends everywhere."""
    if len(grids) == 1:
        return None
    lengths = torch.tensor([t * h * w for t, h, w in grids], device=device)
    image = torch.repeat_interleave(torch.arange(len(grids), device=device), lengths)
    return (image[:, None] == image[None, :])[None, None]


def eager_vision_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """Softmax attention with the softmax in fp32, as transformers' attention interface calls it: [B, heads, L, d]
    inputs, a boolean mask, and [B, L, heads, d] output."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class KimiK3VisionMLP(nn.Module):
    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(config.vt_hidden_size, config.vt_intermediate_size, bias=config.linear_bias)
        self.fc1 = nn.Linear(config.vt_intermediate_size, config.vt_hidden_size, bias=config.linear_bias)
        self.activation = ACT2FN[config.activation_func]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.activation(self.fc0(x)))


class KimiK3VisionEncoderLayer(GradientCheckpointingLayer):
    """``x + wo(attention(rope(wqkv(norm0(x)))))``, then ``x + mlp(norm1(x))``. The q/k/v width (12 heads of 128 in
    the release) differs from the residual width; the norms use torch's default epsilon, as the release does."""

    is_causal = False

    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.vt_num_attention_heads
        self.head_dim = config.head_dim
        self.norm0 = nn.RMSNorm(config.vt_hidden_size)
        self.norm1 = nn.RMSNorm(config.vt_hidden_size)
        self.wqkv = nn.Linear(config.vt_hidden_size, 3 * config.qkv_hidden_size, bias=config.attn_bias)
        self.wo = nn.Linear(config.qkv_hidden_size, config.vt_hidden_size, bias=config.attn_bias)
        self.mlp = KimiK3VisionMLP(config)

    def attention(self, x: torch.Tensor, angles: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        length = x.shape[0]
        query, key, value = self.wqkv(x).view(length, 3, self.num_heads, self.head_dim).unbind(1)
        query, key = apply_vision_rotary(query, angles), apply_vision_rotary(key, angles)
        query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_vision_attention)
        output, _ = attend(self, query, key, value, mask, scaling=self.head_dim**-0.5, dropout=0.0, is_causal=False)
        return self.wo(output.reshape(length, -1))

    def forward(self, hidden_states: torch.Tensor, angles: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        hidden_states = hidden_states + self.attention(self.norm0(hidden_states), angles, mask)
        return hidden_states + self.mlp(self.norm1(hidden_states))


# ---------------------------------------------------------------------------------------------------------------------
# Tower (MoonViT3d) and its merge
# ---------------------------------------------------------------------------------------------------------------------
def temporal_pool_merge(hidden_states: torch.Tensor, grids, kernel: tuple[int, int]) -> list[torch.Tensor]:
    """Per image [(h/kh)·(w/kw), kh·kw, D]: each kernel group of patches, averaged over the frames (``sd2_tpool``)."""
    kernel_height, kernel_width = kernel
    merged, start = [], 0
    for frames, height, width in grids:
        if height % kernel_height or width % kernel_width:
            raise ValueError(f"an image grid of {height} x {width} patches does not split into {kernel} merge groups")
        patches = hidden_states[start : start + frames * height * width]
        groups = patches.view(frames, height // kernel_height, kernel_height, width // kernel_width, kernel_width, -1)
        pooled = groups.permute(0, 1, 3, 2, 4, 5).mean(dim=0)
        merged.append(pooled.reshape(-1, kernel_height * kernel_width, pooled.shape[-1]))
        start += frames * height * width
    return merged


class KimiK3VisionEncoder(nn.Module):
    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.blocks = nn.ModuleList(KimiK3VisionEncoderLayer(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = nn.RMSNorm(config.vt_hidden_size)

    def forward(self, hidden_states: torch.Tensor, grids) -> torch.Tensor:
        angles = vision_rotary_angles(grids, self.head_dim, hidden_states.device)
        mask = same_image_mask(grids, hidden_states.device)
        for block in self.blocks:
            hidden_states = block(hidden_states, angles, mask)
        return self.final_layernorm(hidden_states)


class KimiK3VisionTower(nn.Module):
    """MoonViT3d: native-resolution images (and short clips) packed into one sequence, each attending only to
    itself; returns each image's merge groups [(h/2)(w/2), 4, D]."""

    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        self.merge_kernel_size = tuple(config.merge_kernel_size)
        self.patch_embed = KimiK3VisionPatchEmbed(config)
        self.encoder = KimiK3VisionEncoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        grids = image_grids(grid_thws)
        hidden_states = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype), grids)
        return temporal_pool_merge(self.encoder(hidden_states, grids), grids, self.merge_kernel_size)


# ---------------------------------------------------------------------------------------------------------------------
# Projector (patch merger v2): concatenated merge group -> Linear -> GELU -> Linear -> RMSNorm, no biases
# ---------------------------------------------------------------------------------------------------------------------
class KimiK3PatchMergerProjector(nn.Module):
    def __init__(self, config: KimiK3VisionConfig):
        super().__init__()
        merged_width = config.mm_hidden_size * config.tokens_per_merge
        self.proj = nn.Sequential(
            nn.Linear(merged_width, merged_width, bias=False),
            ACT2FN[config.projector_hidden_act],
            nn.Linear(merged_width, config.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(config.text_hidden_size, eps=config.projector_ln_eps)

    def forward(self, merge_groups: list[torch.Tensor]) -> list[torch.Tensor]:
        lengths = [groups.shape[0] for groups in merge_groups]
        flat = torch.cat([groups.flatten(1) for groups in merge_groups])
        return list(self.post_norm(self.proj(flat)).split(lengths))


# ---------------------------------------------------------------------------------------------------------------------
# Merging image tokens into the text (LLaVA): each placeholder becomes its image's tokens
# ---------------------------------------------------------------------------------------------------------------------
def merged_token_sources(
    input_ids: torch.Tensor, image_token_counts: torch.Tensor, placeholder_id: int, left_padding: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] indices into the rows ``[text tokens (B·S, row-major) ‖ image tokens (N) ‖ one padding row]`` that
    make the merged sequences: each placeholder is replaced by its image's tokens (images in row-major placeholder
    order), rows of different merged lengths are padded (on the left when ``left_padding``). Also [B, S]: where each
    input token ends up, for a placeholder its image's last token (the one that predicts the next input token)."""
    batch_size, seq_len = input_ids.shape
    is_image = input_ids == placeholder_id
    if int(is_image.sum()) != len(image_token_counts):
        raise ValueError(
            f"input_ids hold {int(is_image.sum())} media placeholder token(s) (id {placeholder_id}) for "
            f"{len(image_token_counts)} image(s); put one placeholder where each image goes"
        )
    widths = torch.ones_like(input_ids)
    widths[is_image] = image_token_counts
    starts = widths.cumsum(-1) - widths
    lengths = widths.sum(-1)
    length = int(lengths.max())
    shift = (length - lengths) if left_padding else torch.zeros_like(lengths)
    total_images = int(image_token_counts.sum())
    sources = input_ids.new_full((batch_size, length), batch_size * seq_len + total_images)
    rows, columns = (~is_image).nonzero(as_tuple=True)
    sources[rows, shift[rows] + starts[rows, columns]] = rows * seq_len + columns
    rows, columns = is_image.nonzero(as_tuple=True)
    image_rows = rows.repeat_interleave(image_token_counts)
    first = (shift[rows] + starts[rows, columns]).repeat_interleave(image_token_counts)
    offset = torch.arange(total_images, device=input_ids.device)
    within = offset - (image_token_counts.cumsum(0) - image_token_counts).repeat_interleave(image_token_counts)
    sources[image_rows, first + within] = batch_size * seq_len + offset
    return sources, shift[:, None] + starts + widths - 1


def merge_image_tokens(
    input_ids: torch.Tensor,
    inputs_embeds: torch.Tensor,
    image_features: list[torch.Tensor],
    config: KimiK3VisionConfig,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The merged embeddings, attention mask (image tokens attended, padding not), labels (``ignore_index`` at
    image tokens and padding) and each input token's merged position (`merged_token_sources`). Rows that grow less
    are padded on the left, where decoding continues from the last token, unless the batch is padded on the right (a
    zero in the mask's last column), as the release does."""
    for name, tensor in (("attention_mask", attention_mask), ("labels", labels)):
        if tensor is not None and tensor.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {list(tensor.shape)}; with pixel_values it must match input_ids {list(input_ids.shape)}"
            )
    counts = torch.tensor([f.shape[0] for f in image_features], device=input_ids.device, dtype=input_ids.dtype)
    left_padding = attention_mask is None or not bool((attention_mask[:, -1] == 0).any())
    sources, positions = merged_token_sources(input_ids, counts, config.media_placeholder_token_id, left_padding)
    hidden = inputs_embeds.shape[-1]
    features = torch.cat(image_features).to(inputs_embeds.dtype)
    rows = torch.cat([inputs_embeds.reshape(-1, hidden), features, inputs_embeds.new_zeros(1, hidden)])
    text_mask = attention_mask.flatten() if attention_mask is not None else torch.ones_like(input_ids.flatten())
    mask_rows = torch.cat([text_mask, text_mask.new_ones(features.shape[0]), text_mask.new_zeros(1)])
    merged_labels = None
    if labels is not None:
        ignored = labels.new_full((features.shape[0] + 1,), config.ignore_index)
        merged_labels = torch.cat([labels.flatten(), ignored])[sources]
    return rows[sources], mask_rows[sources], merged_labels, positions


def repeat_images_per_prompt(pixel_values, grid_thws, input_ids, placeholder_id: int, times: int) -> dict:
    """``pixel_values`` and ``grid_thws`` with each prompt's images (in placeholder order) repeated ``times`` times in
    a row, as the prompts of ``input_ids`` are."""
    images_per_prompt = (input_ids == placeholder_id).sum(-1).tolist()
    patches = [t * h * w for t, h, w in image_grids(grid_thws)]
    by_image = list(pixel_values.split(patches))
    pixels, grids, first = [], [], 0
    for count in images_per_prompt:
        for _ in range(times):
            pixels += by_image[first : first + count]
            grids.append(grid_thws[first : first + count])
        first += count
    return {"pixel_values": torch.cat(pixels), "grid_thws": torch.cat(grids)}


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class KimiK3VLCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    attention_mask (`torch.LongTensor` of shape `(batch_size, merged_length)`, *optional*):
        The attention mask of the merged sequences (image tokens in place of their placeholders), which the cache now
        holds; `generate` continues from it.
    """

    attention_mask: torch.LongTensor | None = None


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel, GenerationMixin):
    """Kimi K3 with eyes: images are encoded by the tower, projected to the language model's width, and replace their
    ``media_placeholder_token_id`` tokens (the sequence grows by n_tokens − 1 per image); ``KimiK3ForCausalLM`` runs
    on the merged sequence unchanged. In cached generation the images are encoded once, in the prefill."""

    base_model_prefix = "language_model"
    _no_split_modules = ["KimiK3DecoderLayer", "KimiK3VisionEncoderLayer"]
    _keys_to_ignore_on_load_unexpected = None

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        vision_config = config.vision_config
        if vision_config is None:
            raise ValueError("KimiK3ForConditionalGeneration needs config.vision_config (a KimiK3VisionConfig)")
        if vision_config.text_hidden_size != config.hidden_size:
            raise ValueError(
                f"vision_config.text_hidden_size={vision_config.text_hidden_size} must equal the language model's "
                f"hidden_size={config.hidden_size}"
            )
        if vision_config._attn_implementation is None:  # resolved for the model's config alone
            vision_config._attn_implementation = config._attn_implementation
        self.vision_tower = KimiK3VisionTower(vision_config)
        self.mm_projector = KimiK3PatchMergerProjector(vision_config)
        self.language_model = KimiK3ForCausalLM(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.language_model.set_output_embeddings(value)

    def get_decoder(self):
        return self.language_model.get_decoder()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, KimiK3VisionPositionEmbedding):
            init.normal_(module.weight)  # unit variance, as the release initialises its table

    def get_image_features(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        """Each image's tokens [(h/2)(w/2), hidden_size], in the language model's dtype."""
        projected = self.mm_projector(self.vision_tower(pixel_values, grid_thws))
        return [features.to(self.get_input_embeddings().weight.dtype) for features in projected]

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> KimiK3VLCausalLMOutputWithPast:
        r"""
        pixel_values (`torch.Tensor` of shape `(num_patches, 3, patch_size, patch_size)`, *optional*):
            The patches of every image of the batch, one image after another (the processor's output).
        grid_thws (`torch.LongTensor` of shape `(num_images, 3)`, *optional*):
            Frames, rows and columns of patches of each image, in the order of the placeholders in `input_ids`.
        """
        merged = self.merge_images(input_ids, pixel_values, grid_thws, attention_mask, inputs_embeds, labels, kwargs)
        if merged is not None:
            input_ids, inputs_embeds, attention_mask, labels, _ = None, *merged
        outputs = self.language_model(
            input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask, labels=labels, **kwargs
        )
        return KimiK3VLCausalLMOutputWithPast(**outputs, attention_mask=attention_mask if merged else None)

    def merge_images(self, input_ids, pixel_values, grid_thws, attention_mask, inputs_embeds, labels, kwargs):
        """`merge_image_tokens` on the encoded images: the merged embeddings, attention mask, labels and positions;
        None without images."""
        if pixel_values is None or grid_thws is None or len(grid_thws) == 0:
            return None
        if input_ids is None:
            raise ValueError("pixel_values need input_ids: each image replaces a media placeholder token there")
        if kwargs.get("position_ids") is not None:
            raise ValueError("position_ids cannot be given with pixel_values: the images change the positions")
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        features = self.get_image_features(pixel_values, grid_thws)
        return merge_image_tokens(input_ids, inputs_embeds, features, self.config.vision_config, attention_mask, labels)

    @property
    def base_model(self) -> "KimiK3VisionLanguageBody":
        """The body without the LM head, as transformers' vision-language models expose it (a view: the tensors keep
        their released names under ``language_model.``, ``vision_tower.`` and ``mm_projector.``)."""
        return KimiK3VisionLanguageBody(self)

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """Beams and several sequences per prompt: each prompt's images are repeated with it (transformers repeats
        every tensor along dim 0, which for the packed patches would interleave patches of one image)."""
        images = {key: model_kwargs.pop(key, None) for key in ("pixel_values", "grid_thws")}
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs
        )
        if expand_size > 1 and images["pixel_values"] is not None and images["grid_thws"] is not None:
            images = repeat_images_per_prompt(images["pixel_values"], images["grid_thws"], input_ids[::expand_size],
                                              self.config.vision_config.media_placeholder_token_id, expand_size)
        return input_ids, {**model_kwargs, **images}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        """After the prefill the cache holds the merged sequences: later steps extend their attention mask. Without a
        cache every step merges the images into the prompt again, and the prompt's mask is the one to extend."""
        if outputs.get("attention_mask") is not None and model_kwargs.get("use_cache", True):
            model_kwargs["attention_mask"] = outputs["attention_mask"]
        return super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)


class KimiK3VisionLanguageBody:
    """``base_model`` of the vision-language model. Called, it is the body without the LM head: the images merged
    into the text and the decoder stack run, with the hidden states returned at the positions of ``input_ids`` (a
    placeholder's are its image's last token's), so that code applying the LM head itself to the body's output
    against labels of the input's length (TRL's fused LM head) scores what the model's own loss scores. Every other
    attribute is the language model's, the module ``base_model_prefix`` names, which loading and saving address: the
    released names put the LM head inside it, so no module holds the body alone."""

    def __init__(self, owner: KimiK3ForConditionalGeneration):
        self.owner = owner

    def __getattr__(self, name: str):
        if name == "owner":  # not set yet (copy, pickle): no language model to ask
            raise AttributeError(name)
        return getattr(self.owner.language_model, name)

    def __call__(self, input_ids=None, pixel_values=None, grid_thws=None, attention_mask=None, inputs_embeds=None,
                 **kwargs):  # fmt: skip
        decoder = self.owner.language_model.model
        merged = self.owner.merge_images(input_ids, pixel_values, grid_thws, attention_mask, inputs_embeds, None, kwargs)
        if merged is None:
            return decoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)
        inputs_embeds, attention_mask, _, positions = merged
        outputs = decoder(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs)
        hidden = outputs.last_hidden_state
        outputs.last_hidden_state = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        return outputs


KimiK3ForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")

__all__ = ["KimiK3ForConditionalGeneration"]
