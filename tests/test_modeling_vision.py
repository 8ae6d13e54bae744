"""The vision-language model: the released VL key set, the tower, projector and merge against a float64 reference
written here from the architecture's description, and a tiny model's training step and cached generation."""

import math

import pytest
import torch
import torch.nn.functional as F

from configuration_kimi_k3 import KimiK3Config
from configuration_kimi_k3_vision import KimiK3VisionConfig
from modeling_kimi_k3 import KimiK3ForCausalLM
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration, merge_image_tokens
from tests.conftest import tiny_config
from tests.numerics import FP32_EPS, assert_as_accurate, perturb_parameters

PLACEHOLDER = 96  # the tiny vocabulary's last token stands in for the release's <|media_pad|> (163605)
# Grids (frames, rows, columns of 14-pixel patches) around the tiny 8 x 8 position table: equal, smaller, larger and
# non-square, and a two-frame clip.
GRIDS = [(1, 8, 8), (1, 4, 6), (1, 12, 10), (2, 6, 4)]


def tiny_vl_config(attn_implementation: str = "eager", **vision) -> KimiK3Config:
    config = tiny_config(
        vision_config=KimiK3VisionConfig.tiny(32, media_placeholder_token_id=PLACEHOLDER, **vision).to_dict()
    )
    config._attn_implementation = attn_implementation
    return config


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights of unit-scale activations (the default init's 0.02 would leave attention near uniform): matrices
    N(0, 1/fan_in), norm weights 1 + N(0, 0.1²), the position table N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        if not name.startswith(("vision_tower.", "mm_projector.")):
            continue
        noise = torch.randn(parameter.shape, generator=generator)
        if name.endswith("pos_emb.weight"):
            parameter.copy_(noise)
        elif parameter.ndim == 1:
            parameter.copy_(1 + 0.1 * noise)
        else:
            parameter.copy_(noise / math.sqrt(parameter[0].numel()))
    return model


def pixels_for(grids, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    patches = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(patches, 3, 14, 14, generator=torch.Generator().manual_seed(seed))
    return pixel_values, torch.tensor(grids)


# ---------------------------------------------------------------------------------------------------------------------
# The reference: one image at a time, plain tensor algebra in the given dtype
# ---------------------------------------------------------------------------------------------------------------------
def bilinear_matrix(out_size: int, in_size: int, dtype) -> torch.Tensor:
    """Rows of half-pixel-centred linear interpolation weights (sources clamped at the first pixel)."""
    weights = torch.zeros(out_size, in_size, dtype=dtype)
    for i in range(out_size):
        source = max((i + 0.5) * in_size / out_size - 0.5, 0.0)
        low = min(int(source), in_size - 1)
        high, fraction = min(low + 1, in_size - 1), source - low
        weights[i, low] += 1 - fraction
        weights[i, high] += fraction
    return weights


def reference_position_embedding(table: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    dtype, dim = table.dtype, table.shape[-1]
    grid = torch.einsum(
        "yi,ijd,xj->yxd", bilinear_matrix(height, table.shape[0], dtype), table, bilinear_matrix(width, table.shape[1], dtype)
    ).reshape(height * width, dim)
    time = torch.zeros(frames, dim, dtype=dtype)
    for frame in range(frames):
        for i in range(dim // 2):
            angle = frame / 10000 ** (i / (dim / 2))
            time[frame, i], time[frame, dim // 2 + i] = math.sin(angle), math.cos(angle)
    return (grid[None] + time[:, None]).reshape(-1, dim) if frames > 1 else grid


def reference_rotation(height: int, width: int, frames: int, head_dim: int, dtype) -> torch.Tensor:
    """Complex rotations [patches, head_dim/2]: pair 2i turns by column·θ_i, pair 2i+1 by row·θ_i."""
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    angles = torch.zeros(height * width, head_dim // 2, dtype=dtype)
    for row in range(height):
        for column in range(width):
            for i in range(head_dim // 4):
                theta = 10000.0 ** (-4 * i / head_dim)
                angles[row * width + column, 2 * i] = column * theta
                angles[row * width + column, 2 * i + 1] = row * theta
    return torch.polar(torch.ones_like(angles), angles).to(complex_dtype).repeat(frames, 1)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def rotate(x, rotation):
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotation[:, None]).flatten(-2)


def reference_block(p: dict, i: int, x: torch.Tensor, rotation, config: KimiK3VisionConfig) -> torch.Tensor:
    block, eps = f"vision_tower.encoder.blocks.{i}.", FP32_EPS  # torch's default RMSNorm epsilon in fp32
    heads, head_dim = config.vt_num_attention_heads, config.head_dim
    qkv = rms_norm(x, p[block + "norm0.weight"], eps) @ p[block + "wqkv.weight"].T
    q, k, v = qkv.reshape(-1, 3, heads, head_dim).unbind(1)
    q, k = rotate(q, rotation), rotate(k, rotation)
    weights = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim), dim=-1)
    x = x + torch.einsum("hqk,khd->qhd", weights, v).reshape(x.shape[0], -1) @ p[block + "wo.weight"].T
    hidden = gelu_tanh(rms_norm(x, p[block + "norm1.weight"], eps) @ p[block + "mlp.fc0.weight"].T)
    return x + hidden @ p[block + "mlp.fc1.weight"].T


def reference_image_tokens(params: dict, config: KimiK3VisionConfig, pixels, grid, dtype) -> torch.Tensor:
    """One image's projected tokens [(h/2)(w/2), text_hidden_size]."""
    p = {name: tensor.to(dtype) for name, tensor in params.items()}
    frames, height, width = grid
    patch_weight = p["vision_tower.patch_embed.proj.weight"]
    x = pixels.to(dtype).flatten(1) @ patch_weight.flatten(1).T
    x = x + reference_position_embedding(p["vision_tower.patch_embed.pos_emb.weight"], frames, height, width)
    rotation = reference_rotation(height, width, frames, config.head_dim, dtype)
    for i in range(config.vt_num_hidden_layers):
        x = reference_block(p, i, x, rotation, config)
    x = rms_norm(x, p["vision_tower.encoder.final_layernorm.weight"], FP32_EPS).reshape(frames, height, width, -1)
    groups = torch.stack([
        torch.cat([x[:, 2 * row + a, 2 * column + b].mean(0) for a in (0, 1) for b in (0, 1)])
        for row in range(height // 2) for column in range(width // 2)
    ])  # fmt: skip
    hidden = F.gelu(groups @ p["mm_projector.proj.0.weight"].T) @ p["mm_projector.proj.2.weight"].T
    return rms_norm(hidden, p["mm_projector.post_norm.weight"], config.projector_ln_eps)


def reference_features(model, pixel_values, grids, dtype) -> list[torch.Tensor]:
    params = {n: t.detach() for n, t in model.named_parameters() if n.startswith(("vision_tower.", "mm_projector."))}
    starts = torch.tensor([0] + [t * h * w for t, h, w in grids]).cumsum(0)
    return [
        reference_image_tokens(params, model.config.vision_config, pixel_values[starts[i] : starts[i + 1]], grid, dtype)
        for i, grid in enumerate(grids)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------------
RELEASED_BLOCK_SHAPES = {
    "norm0.weight": (1024,), "norm1.weight": (1024,), "wqkv.weight": (4608, 1024), "wo.weight": (1024, 1536),
    "mlp.fc0.weight": (4096, 1024), "mlp.fc1.weight": (1024, 4096),
}  # fmt: skip


def released_vision_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {
        "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
        "vision_tower.encoder.final_layernorm.weight": (1024,),
        "mm_projector.proj.0.weight": (4096, 4096),
        "mm_projector.proj.2.weight": (7168, 4096),
        "mm_projector.post_norm.weight": (7168,),
    }
    for i in range(27):
        shapes.update({f"vision_tower.encoder.blocks.{i}.{name}": shape for name, shape in RELEASED_BLOCK_SHAPES.items()})
    return shapes


def test_released_vl_configuration_has_the_released_vision_tensors_and_unchanged_text_tensors():
    config = KimiK3Config.kimi_k3(vision_config={})
    assert config.vision_config.text_hidden_size == config.hidden_size == 7168
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config)
        text_model = KimiK3ForCausalLM(KimiK3Config.kimi_k3())
    state = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    vision = {name: shape for name, shape in state.items() if not name.startswith("language_model.")}
    assert len(vision) == 168
    assert vision == released_vision_shapes()
    tower = sum(math.prod(shape) for name, shape in vision.items() if name.startswith("vision_tower."))
    assert tower == 401_214_464
    text = {name.removeprefix("language_model."): shape for name, shape in state.items() if name not in vision}
    assert text == {name: tuple(tensor.shape) for name, tensor in text_model.state_dict().items()}


def test_default_config_stays_text_only():
    config = KimiK3Config()
    assert config.vision_config is None
    assert "vision_config" not in config.to_dict() and config.sub_configs == {}
    assert "AutoModelForImageTextToText" not in config.auto_map
    with pytest.raises(ValueError, match="needs config.vision_config"):
        KimiK3ForConditionalGeneration(config)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_tower_and_projector_match_the_float64_reference(attn_implementation):
    model = randomize_(KimiK3ForConditionalGeneration(tiny_vl_config(attn_implementation)))
    pixel_values, grid_thws = pixels_for(GRIDS)
    with torch.no_grad():
        actual = model.get_image_features(pixel_values, grid_thws)  # all four packed into one sequence
    trusted = reference_features(model, pixel_values, GRIDS, torch.float32)
    exact = reference_features(model, pixel_values, GRIDS, torch.float64)
    perturbed = reference_features(perturb_parameters(model, seed=3), pixel_values, GRIDS, torch.float64)
    for i, grid in enumerate(GRIDS):
        assert actual[i].shape == (grid[1] * grid[2] // 4, 32)
        assert_as_accurate(actual[i], trusted[i], exact[i], [perturbed[i]], what=f"image {grid}")


def test_images_attend_only_to_themselves():
    model = randomize_(KimiK3ForConditionalGeneration(tiny_vl_config()))
    pixel_values, grid_thws = pixels_for(GRIDS[:2])
    with torch.no_grad():
        together = model.get_image_features(pixel_values, grid_thws)
        alone = model.get_image_features(pixel_values[64:], grid_thws[1:])
    torch.testing.assert_close(together[1], alone[0], rtol=0, atol=1e-5)


def reference_merge(input_ids, embeds, features, attention_mask, labels, left: bool):
    rows, image = [], iter(features)
    for b in range(input_ids.shape[0]):
        row = []
        for s, token in enumerate(input_ids[b].tolist()):
            if token == PLACEHOLDER:
                row += [(vector, 1, -100) for vector in next(image)]
            else:
                row.append((embeds[b, s], int(attention_mask[b, s]), int(labels[b, s])))
        rows.append(row)
    length = max(map(len, rows))
    padding = (torch.zeros(embeds.shape[-1]), 0, -100)
    rows = [[padding] * (length - len(row)) + row if left else row + [padding] * (length - len(row)) for row in rows]
    return (
        torch.stack([torch.stack([e for e, _, _ in row]) for row in rows]),
        torch.tensor([[m for _, m, _ in row] for row in rows]),
        torch.tensor([[label for _, _, label in row] for row in rows]),
    )


@pytest.mark.parametrize("left", [True, False])
def test_merge_puts_each_image_at_its_placeholder(left):
    """Two images in one sample, none in another, padding on either side; sequences grow by n − 1 per image."""
    P = PLACEHOLDER
    rows = [[0, 0, 5, 6, 7, 8], [5, P, 6, P, 7, 8]] if left else [[5, 6, 7, 8, 0, 0], [5, P, 6, P, 7, 8]]
    input_ids = torch.tensor(rows)
    attention_mask = (input_ids != 0).long()
    labels = torch.where(attention_mask.bool(), input_ids, -100)
    embeds = torch.randn(2, 6, 32)
    features = [torch.randn(3, 32), torch.randn(5, 32)]
    config = KimiK3VisionConfig.tiny(32, media_placeholder_token_id=P)
    merged = merge_image_tokens(input_ids, embeds, features, config, attention_mask, labels)
    expected = reference_merge(input_ids, embeds, features, attention_mask, labels, left)
    assert merged[0].shape == (2, 6 + 2 + 4, 32)
    for actual, wanted in zip(merged[:3], expected):
        assert torch.equal(actual, wanted)
    # Each input token's merged position holds it; a placeholder's holds its image's last token.
    last_of_image = iter([features[0][-1], features[1][-1]])
    for row, column in zip(*torch.where(attention_mask.bool())):
        at = merged[0][row, merged[3][row, column]]
        assert torch.equal(at, next(last_of_image) if input_ids[row, column] == P else embeds[row, column])


def test_merge_refuses_a_placeholder_count_that_does_not_match_the_images():
    config = KimiK3VisionConfig.tiny(32, media_placeholder_token_id=PLACEHOLDER)
    input_ids = torch.tensor([[5, PLACEHOLDER, 6]])
    with pytest.raises(ValueError, match="1 media placeholder token.*for 2 image"):
        merge_image_tokens(input_ids, torch.randn(1, 3, 32), [torch.randn(2, 32)] * 2, config)


def test_merge_refuses_a_mask_of_another_length():
    config = KimiK3VisionConfig.tiny(32, media_placeholder_token_id=PLACEHOLDER)
    input_ids = torch.tensor([[5, PLACEHOLDER, 6]])
    with pytest.raises(ValueError, match=r"attention_mask has shape \[1, 4\]; with pixel_values it must match input_ids"):
        merge_image_tokens(input_ids, torch.randn(1, 3, 32), [torch.randn(2, 32)], config, torch.ones(1, 4))


def test_forward_and_backward_with_images_reach_every_part():
    model = KimiK3ForConditionalGeneration(tiny_vl_config()).train()
    pixel_values, grid_thws = pixels_for([(1, 4, 4), (1, 6, 4)])
    input_ids = torch.tensor([[5, PLACEHOLDER, 6, 7], [PLACEHOLDER, 8, 9, 10]])
    output = model(input_ids=input_ids, pixel_values=pixel_values, grid_thws=grid_thws, labels=input_ids)
    assert output.logits.shape == (2, 4 + 5, 97)
    assert torch.isfinite(output.loss)
    output.loss.backward()
    for name in ("vision_tower.patch_embed.proj.weight", "vision_tower.encoder.blocks.0.wqkv.weight",
                 "mm_projector.proj.0.weight", "language_model.model.embed_tokens.weight"):
        gradient = model.get_parameter(name).grad
        assert gradient is not None and torch.isfinite(gradient).all() and gradient.abs().sum() > 0, name


def test_cached_generation_with_images_equals_full_forwards():
    """Left padding, a row without an image beside a row with two; the images are encoded once, in the prefill."""
    model = randomize_(KimiK3ForConditionalGeneration(tiny_vl_config())).eval()
    pixel_values, grid_thws = pixels_for([(1, 4, 6), (1, 6, 4)])
    input_ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [5, PLACEHOLDER, 6, PLACEHOLDER, 7, 8, 9]])
    attention_mask = (input_ids != 0).long()
    images = dict(pixel_values=pixel_values, grid_thws=grid_thws)
    calls = []
    model.vision_tower.register_forward_hook(lambda *args: calls.append(1))
    generated = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **images
    )
    assert len(calls) == 1
    greedy, mask, finished = input_ids, attention_mask, torch.zeros(2, 1, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(6):  # a row that has produced the end-of-sequence token continues with padding, as in generate
            logits = model(input_ids=greedy, attention_mask=mask, use_cache=False, **images).logits
            token = logits[:, -1:].argmax(-1).masked_fill(finished, 0)
            finished |= token == model.config.eos_token_id
            greedy, mask = torch.cat([greedy, token], dim=1), torch.cat([mask, torch.ones_like(token)], dim=1)
    assert torch.equal(generated, greedy)
    uncached = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False,
        **images,
    )
    assert torch.equal(uncached, greedy)


def test_bf16_model_casts_pixels_to_the_tower_and_features_to_the_language_model():
    model = KimiK3ForConditionalGeneration(tiny_vl_config()).to(torch.bfloat16).eval()
    pixel_values, grid_thws = pixels_for([(1, 4, 6)])  # fp32 pixels, as the processor returns them
    with torch.no_grad():
        features = model.get_image_features(pixel_values, grid_thws)
        logits = model(input_ids=torch.tensor([[5, PLACEHOLDER, 6]]), pixel_values=pixel_values, grid_thws=grid_thws).logits
    assert features[0].dtype == torch.bfloat16 and features[0].shape == (6, 32)
    assert logits.shape == (1, 3 + 5, 97) and torch.isfinite(logits.float()).all()


def test_several_sequences_per_prompt_repeat_each_prompts_images():
    """num_return_sequences copies each prompt with its own images: every copy decodes as the prompt alone does."""
    model = randomize_(KimiK3ForConditionalGeneration(tiny_vl_config())).eval()
    pixel_values, grid_thws = pixels_for([(1, 4, 6), (1, 6, 4), (1, 4, 4)])
    input_ids = torch.tensor([[5, PLACEHOLDER, 6, PLACEHOLDER, 7], [8, 9, PLACEHOLDER, 10, 11]])
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    doubled = model.generate(input_ids, pixel_values=pixel_values, grid_thws=grid_thws, num_return_sequences=2,
                             num_beams=2, **options)
    first = model.generate(input_ids[:1], pixel_values=pixel_values[:48], grid_thws=grid_thws[:2], num_beams=2,
                           num_return_sequences=2, **options)
    second = model.generate(input_ids[1:], pixel_values=pixel_values[48:], grid_thws=grid_thws[2:], num_beams=2,
                            num_return_sequences=2, **options)
    assert torch.equal(doubled, torch.cat([first, second]))
