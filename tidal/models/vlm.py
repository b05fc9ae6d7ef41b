"""A tiny vision-language model built locally, its processor, M-RoPE positions and log-probs with images.

The model is a transformers ``Qwen2VLForConditionalGeneration`` (Qwen2-VL, Wang et al. 2024, arXiv
2409.12191): a ViT over 14x14 patches (two frames per patch in time; a still image is its own second frame),
a merger that folds each 2x2 block of patch features into one language-model token, and a Qwen2 decoder
whose rotary embedding is M-RoPE. Qwen2-VL rather than Qwen2.5-VL: its vision tower has no window attention
and its ``get_rope_index`` no video timing (``second_per_grid_ts``), so the image path is the same one with
fewer parts; what tidal computes here (positions, features, log-probs) carries over to Qwen2.5-VL, whose text
positions follow the same rule.

Built tiny (``VLMConfig``: ~0.8M parameters, vision depth 2, width 64; text 2 layers, width 128) with
a character-level chat tokenizer (``tiny.build_chat_tokenizer`` plus Qwen2-VL's vision markers) whose chat
template renders OpenAI-style content parts as Qwen2-VL's does: an ``image``/``image_url`` part becomes
``<|vision_start|><|image_pad|><|vision_end|>`` and the processor widens ``<|image_pad|>`` to one token per
merged 2x2 patch block, so a 56x56 image is (56/14)^2 / 2^2 = 4 tokens. (Qwen2-VL's own template also opens
every conversation with a default system message; it is left out, as it would cost the character model
~40 tokens a prompt.) Everything is saved with ``save_pretrained`` and loads from a folder; nothing downloads.

The processor is ``ImageTextProcessor``, Qwen2-VL's processor without its video half: transformers 5.24's
``Qwen2VLProcessor`` requires a video processor, and every video processor needs torchvision, which tidal
does not install (its CPU wheels do not match tidal's torch; FACTS.md). Images use the PIL image processor
(``Qwen2VLImageProcessorPil``), which is what ``Qwen2VLImageProcessor`` resolves to without torchvision.

M-RoPE (Qwen2-VL sec. 2.1, "Multimodal Rotary Position Embedding"): every token has three position ids
(temporal, height, width), each rotating its own slice of the head dimension (``mrope_section``). A text
token has the same id in all three, one more than the token before. An image's tokens share the temporal id
and take their row and column in the merged grid as height and width ids, all offset by the position where
the image starts; the text after the image resumes at that start plus the grid's larger side. Positions
therefore grow more slowly than token indices, and a token generated after the prompt at index i has
position i + delta in all three components, where delta = (largest prompt position + 1) - prompt length
(<= 0). ``mrope_positions`` computes both for one sequence, from its token ids and its images' grids, the
one rule the engine (prefill, then i + delta while decoding) and the trainer (the whole sequence at once)
share; tests/models/test_vlm.py checks it equals transformers' ``get_rope_index`` and its decode-time
``compute_3d_position_ids``.

Log-probs with images (``vlm_token_logprobs``): the vision tower runs once per distinct image of a batch
(a group's G samples share their prompt's image), its merged features are gathered into every row that
shows the image (index, not recompute, so the gradient of each use adds up in the one computation), placed
over the image-pad tokens' embeddings, and the decoder runs on ``inputs_embeds`` with the M-RoPE positions
passed explicitly. The head and log-softmax run in float32 through ``logprobs.chunked_head_logprobs``, as
for text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForImageTextToText,
    BatchFeature,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

from tidal.models.char_tokenizers import IM_END, IM_START, PROCESSOR_ATTR, build_chat_tokenizer, load_tokenizer
from tidal.models.logprobs import chunked_head_logprobs
from tidal.utils.images import load_image

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# Qwen2-VL's chat template (Qwen/Qwen2-VL-7B-Instruct) without its default system message: a string content is
# the text; a list of parts renders an image part (type "image", or an "image"/"image_url" key) as the vision
# markers around one <|image_pad|>, which the processor widens to the image's token count, and a text part as
# its text.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}" + IM_START + "{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    + VISION_START + IMAGE_PAD + VISION_END +
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")


@dataclass
class VLMConfig:
    """The tiny vision-language model and its image processor."""

    hidden_size: int = 128
    """Text decoder width (also the merger's output width: one image token is one decoder embedding)."""
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    family: str = "qwen2_vl"
    """``qwen2_vl`` (the default: Qwen2-VL) or ``qwen2_5_vl`` (Qwen2.5-VL, arXiv 2502.13923: its vision tower has
    window attention in all but ``fullatt_block_indexes``, an RMSNorm and a gated MLP; the language side, the image
    tokens and M-RoPE for images are Qwen2-VL's)."""
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    """How the rotary frequencies of a head (head_dim / 2 = 16 here) split between the temporal, height and
    width ids; Qwen2-VL-7B's is (16, 24, 24) of 64, the same 1/4, 3/8, 3/8 shares."""
    max_position_embeddings: int = 512
    vision_depth: int = 2
    """Vision transformer blocks (Qwen2-VL: 32)."""
    vision_embed_dim: int = 64
    vision_heads: int = 4
    vision_mlp_ratio: int = 2
    patch_size: int = 14
    """Qwen2-VL's ViT patch (pixels per side)."""
    spatial_merge_size: int = 2
    """Each merge x merge block of patches becomes one language token (Qwen2-VL: 2)."""
    min_pixels: int = 56 * 56
    """The image processor resizes each image (keeping its aspect) to between ``min_pixels`` and ``max_pixels``
    pixels with sides that are multiples of patch x merge = 28: 56x56 -> 4 tokens, 112x112 -> 16."""
    max_pixels: int = 112 * 112
    init_seed: int = 0


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """``tiny.build_chat_tokenizer`` (characters, ChatML markers, EOS = ``<|im_end|>``) plus the Qwen2-VL
    vision markers as special tokens and ``VLM_CHAT_TEMPLATE``. ``<|video_pad|>`` is there because Qwen2-VL's
    processor and config name a video token; no video is ever rendered."""
    tok = build_chat_tokenizer()
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


class ImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer but no video processor (module docstring:
    transformers 5.24 requires one, and its video processors need torchvision). Everything else (the
    ``<|image_pad|>`` expansion, ``mm_token_type_ids``, ``save_pretrained``/``from_pretrained``) is Qwen2-VL's."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = IMAGE_PAD, VIDEO_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


def build_processor(cfg: VLMConfig, tokenizer: PreTrainedTokenizerFast | None = None) -> ImageTextProcessor:
    """The tiny model's processor: Qwen2-VL's PIL image processor sized by ``cfg`` and ``build_vlm_tokenizer``."""
    tokenizer = tokenizer if tokenizer is not None else build_vlm_tokenizer()
    images = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, patch_size=cfg.patch_size,
                                      merge_size=cfg.spatial_merge_size)
    return ImageTextProcessor(images, tokenizer, chat_template=tokenizer.chat_template)


def build_vlm(cfg: VLMConfig, processor: ImageTextProcessor) -> Qwen2VLForConditionalGeneration:
    """A randomly initialized tiny Qwen2-VL (float32, SDPA attention) whose vocabulary and vision-token ids are
    ``processor``'s tokenizer's."""
    tok = processor.tokenizer
    head_dim = cfg.hidden_size // cfg.num_heads
    if sum(cfg.mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {cfg.mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
    text = dict(vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
                max_position_embeddings=cfg.max_position_embeddings, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": list(cfg.mrope_section)})
    common = dict(depth=cfg.vision_depth, num_heads=cfg.vision_heads, patch_size=cfg.patch_size,
                  spatial_merge_size=cfg.spatial_merge_size, temporal_patch_size=2)
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
        ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END))}
    if cfg.family == "qwen2_vl":
        vision = dict(common, embed_dim=cfg.vision_embed_dim, hidden_size=cfg.hidden_size,
                      mlp_ratio=cfg.vision_mlp_ratio)
        config_cls, cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    elif cfg.family == "qwen2_5_vl":
        # windows of 2 x 2 merged tokens (Qwen2.5-VL-7B: 112 px = 4 x 4); the last block attends over the whole image
        vision = dict(common, hidden_size=cfg.vision_embed_dim, out_hidden_size=cfg.hidden_size,
                      intermediate_size=cfg.vision_embed_dim * cfg.vision_mlp_ratio,
                      window_size=2 * cfg.patch_size * cfg.spatial_merge_size,
                      fullatt_block_indexes=[cfg.vision_depth - 1])
        config_cls, cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    else:
        raise ValueError(f"VLMConfig.family={cfg.family!r}: one of {', '.join(FAMILIES)}")
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.init_seed)
        model = cls._from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model


FAMILIES = ("qwen2_vl", "qwen2_5_vl")
"""The vision-language families tidal builds, loads (``config.json``'s ``model_type``) and tests."""


def save(model: torch.nn.Module, processor: ProcessorMixin, path: str | Path) -> None:
    """The model (safetensors) and its processor (tokenizer, image processor, chat template) in one folder, as
    ``tiny.save`` writes a text model and its tokenizer (the processor saves as a tokenizer does)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)


def load_processor(path: str | Path) -> ImageTextProcessor:
    """The processor of a Qwen2-VL folder (the tiny model's or a real checkpoint's), image half only.

    The tokenizer comes through ``tiny.load_tokenizer``, which keeps the tiny model's character tokenizer as
    saved (``AutoTokenizer`` would rebuild it as Qwen2's byte-level BPE from the model type)."""
    path = Path(path)
    tokenizer = load_tokenizer(path)
    images = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    template = path / "chat_template.jinja"
    chat_template = template.read_text() if template.exists() else tokenizer.chat_template
    return ImageTextProcessor(images, tokenizer, chat_template=chat_template)


def load(path: str | Path) -> tuple[torch.nn.Module, ImageTextProcessor]:
    """A Qwen2-VL or Qwen2.5-VL model (float32; the class its ``config.json`` names) and its processor from a local
    folder; never the hub."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no Hugging Face model at {path} (config.json missing)")
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, load_processor(path)


# ---- prompts with images -------------------------------------------------------------------------------------

def user_message(text: str, num_images: int) -> list[dict]:
    """One user turn: ``num_images`` image parts, then the text (Qwen2-VL's examples put images first)."""
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(num_images)),
                                         {"type": "text", "text": text}]}]


def message_images(messages: list[dict], images: list[Any] | None = None, where: str = "messages") -> list[Any]:
    """The images of ``messages``' image parts as RGB PIL images, in the order their placeholders render.

    A part that holds its image (``image_url`` with a data URL, ``image`` with a path, bytes or PIL image) gives
    it; a bare ``{"type": "image"}`` part takes the next of ``images``. All go through ``load_image``, so a bad
    one is an error naming ``where`` and the part."""
    spare = list(images or [])
    found = []
    for m, message in enumerate(messages):
        content = message.get("content")
        for p, part in enumerate(content if isinstance(content, list) else []):
            if not (part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part):
                continue
            at = f"{where}[{m}].content[{p}]"
            if part.get("image") is not None or part.get("image_url") is not None:
                found.append(load_image(part, at))
            elif spare:
                found.append(load_image(spare.pop(0), at))
            else:
                raise ValueError(f"{at}: an image part with no image, and no images left to fill it")
    if spare:
        raise ValueError(f"{where}: {len(spare)} images left over after filling the image parts")
    return found


def encode_messages(processor: ProcessorMixin, messages: list[dict], images: list[Any] | None = None,
                    add_generation_prompt: bool = True, where: str = "messages") -> BatchFeature:
    """Token ids, ``attention_mask``, ``mm_token_type_ids``, ``pixel_values`` and ``image_grid_thw`` of one
    conversation (a batch of 1), rendered by the processor's chat template (``message_images`` for the images)."""
    loaded = message_images(messages, images, where)
    text = processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    if text.count(IMAGE_PAD) != len(loaded):
        raise ValueError(f"{where}: the template rendered {text.count(IMAGE_PAD)} image placeholders for "
                         f"{len(loaded)} images")
    return processor(text=[text], images=loaded or None, return_tensors="pt")


def encode_prompt(processor: ProcessorMixin, text: str, images: list[Any], where: str = "prompt") -> BatchFeature:
    """A single-turn prompt (``user_message``) with the generation prompt, ready for prefill."""
    return encode_messages(processor, user_message(text, len(images)), images, where=where)



def prompt_ids(processor: ProcessorMixin, text: str, images: list[Any], system_prompt: str | None = None,
               where: str = "prompt") -> list[int]:
    """The ids a vision-language model reads for a single-turn prompt with ``images``: the images then the text as
    the user turn (after ``system_prompt``, if any), the generation prompt, each ``<|image_pad|>`` widened to its
    image's token count. The one rendering the engine, the evaluation and the warm start share
    (``rollout/requests.py``). Equal to ``encode_messages``' ids (tested) without computing pixel values: the
    count comes from the image's size through the image processor's own resize rule, 15x faster."""
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages = [*system, *user_message(text, len(images))]
    loaded = message_images(messages, images, where)
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = rendered.split(IMAGE_PAD)
    if len(pieces) - 1 != len(loaded):
        raise ValueError(f"{where}: the template rendered {len(pieces) - 1} image placeholders for {len(loaded)} "
                         "images")
    images_of = processor.image_processor
    counts = [images_of.get_number_of_image_patches(im.height, im.width, {}) // images_of.merge_size**2
              for im in loaded]
    widened = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:]))
    return processor.tokenizer(widened).input_ids


# ---- the processor rides on the tokenizer ---------------------------------------------------------------------
# A run hands its tokenizer to every part that renders prompts (engines, evaluation, the warm start, the recorder);
# a vision-language model's processor is attached to that tokenizer where the model is loaded, as the prompt
# format is (``models/prompts.attach``), so each of them finds it without another argument threaded through.

def attach_processor(tokenizer, processor: ProcessorMixin):
    """Make ``processor`` the one ``processor_of(tokenizer)`` returns (returns the tokenizer)."""
    setattr(tokenizer, PROCESSOR_ATTR, processor)
    return tokenizer


def processor_of(tokenizer) -> ProcessorMixin | None:
    """The image processor attached to ``tokenizer`` (a vision-language model's), or None (a text model)."""
    return getattr(tokenizer, PROCESSOR_ATTR, None)


def is_vlm(model: torch.nn.Module) -> bool:
    """True for a model with a vision tower this module knows how to feed (Qwen2-VL's layout, PEFT-wrapped or not)."""
    config = getattr(hf_model(model), "config", None)
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


# ---- M-RoPE positions ----------------------------------------------------------------------------------------

def mrope_positions(input_ids_t: torch.Tensor | list[int], image_grid_thw_n3: torch.Tensor | None, image_token_id: int,
                    spatial_merge_size: int = 2) -> tuple[torch.Tensor, int]:
    """M-RoPE position ids [3, T] of one unpadded sequence and its rope delta (module docstring).

    ``image_grid_thw_n3`` holds the (t, h, w) patch grid of each image in the order its tokens appear; image i
    owns the next t*h*w / merge^2 image tokens, which must be consecutive. A count that does not add up is an
    error here rather than a silently shifted position for every later token. A token generated after these
    T tokens at index i >= T gets position i + delta in all three components."""
    ids_t = torch.as_tensor(input_ids_t, dtype=torch.long)
    num_tokens = ids_t.shape[0]
    image_at = (ids_t == image_token_id).nonzero().squeeze(1).tolist()
    grids = [] if image_grid_thw_n3 is None else [tuple(int(x) for x in g) for g in image_grid_thw_n3]
    sizes = [t * h * w // spatial_merge_size**2 for t, h, w in grids]
    if sum(sizes) != len(image_at):
        raise ValueError(f"{len(image_at)} image tokens in the sequence but its {len(grids)} image grids need "
                         f"{sum(sizes)} ({sizes})")
    pos_3t = torch.empty(3, num_tokens, dtype=torch.long)
    cursor, position, used = 0, 0, 0  # next token index, next text position, image tokens consumed
    for k, ((t, h, w), size) in enumerate(zip(grids, sizes)):
        start = image_at[used]
        if image_at[used + size - 1] != start + size - 1:
            raise ValueError(f"image {k}: its {size} tokens from index {start} on are not consecutive")
        pos_3t[:, cursor:start] = torch.arange(position, position + start - cursor)
        position += start - cursor
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        block = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
        pos_3t[:, start:start + size] = block.reshape(3, -1) + position
        position += max(gh, gw)
        cursor, used = start + size, used + size
    pos_3t[:, cursor:] = torch.arange(position, position + num_tokens - cursor)
    delta = int(pos_3t.max()) + 1 - num_tokens if num_tokens else 0
    return pos_3t, delta


def mrope_position_ids(input_ids_bt: torch.Tensor, attention_mask_bt: torch.Tensor | None,
                       image_grid_thw_n3: torch.Tensor | None, image_token_id: int,
                       spatial_merge_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``mrope_positions`` of each row's unmasked tokens, laid out as transformers' ``get_rope_index``: positions
    [3, B, T] (0 at padding) and deltas [B, 1]. The grids are every row's images in row order."""
    b, t = input_ids_bt.shape
    mask_bt = torch.ones_like(input_ids_bt, dtype=torch.bool) if attention_mask_bt is None else attention_mask_bt.bool()
    pos_3bt = torch.zeros(3, b, t, dtype=torch.long)
    deltas, taken = [], 0
    for row in range(b):
        ids = input_ids_bt[row][mask_bt[row]].cpu()
        count = int((ids == image_token_id).sum())
        grids, need = [], 0
        while need < count:
            grid = image_grid_thw_n3[taken + len(grids)]
            grids.append(grid)
            need += int(grid.prod()) // spatial_merge_size**2
        taken += len(grids)
        pos, delta = mrope_positions(ids, torch.stack(grids) if grids else None, image_token_id, spatial_merge_size)
        pos_3bt[:, row, mask_bt[row].cpu()] = pos
        deltas.append(delta)
    return pos_3bt.to(input_ids_bt.device), torch.tensor(deltas, device=input_ids_bt.device).unsqueeze(1)


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """Positions [3, count] of ``count`` text tokens generated from token index ``start`` on (i + delta)."""
    return torch.arange(start + delta, start + delta + count).expand(3, count)


# ---- log-probs with images -----------------------------------------------------------------------------------

@dataclass
class VisionBatch:
    """Rows of prompt (with images) + response, and each distinct image once.

    ``row_images[b]`` lists, in the order row b's image tokens appear, which of the distinct images each is
    (indices into ``image_grid_thw_n3``); a group of G samples of one prompt lists the same index G times."""

    input_ids_bt: torch.Tensor
    """[B, T] long, right-padded as ``TrainBatch`` (any padding the mask marks works)."""
    attention_mask_bt: torch.Tensor
    """[B, T], 1 for real tokens."""
    pixel_values: torch.Tensor | None
    """[patches of all distinct images, 3 * 2 * patch^2]: the image processor's output for the distinct images."""
    image_grid_thw_n3: torch.Tensor | None
    """[distinct images, 3] long: each distinct image's (t, h, w) patch grid."""
    row_images: list[list[int]]


def image_batch(processor: ProcessorMixin, images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel values and grids of ``images`` (each once), for ``VisionBatch``."""
    out = processor.image_processor(images=[load_image(im, f"image {i}") for i, im in enumerate(images)],
                                    return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def hf_model(model: torch.nn.Module) -> Qwen2VLForConditionalGeneration:
    """The transformers model inside a PEFT (LoRA) wrapper, or ``model`` itself: the vision tower is reached as
    ``.model.visual``, which a ``PeftModel`` would resolve to another attribute."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def image_tokens(image_grid_thw_n3: torch.Tensor, spatial_merge_size: int = 2) -> list[int]:
    """How many language tokens (merged features) each image's grid becomes: t * h * w / merge^2."""
    return [int(g.prod()) // spatial_merge_size**2 for g in image_grid_thw_n3]


def image_subset(pixel_values: torch.Tensor, image_grid_thw_n3: torch.Tensor,
                 which: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pixel values and grids of images ``which`` (indices, in that order) out of a batch of images whose
    patches are concatenated: image i owns the t * h * w rows after the earlier images'."""
    patches = [int(g.prod()) for g in image_grid_thw_n3]
    starts = [0, *torch.tensor(patches).cumsum(0).tolist()]
    rows = torch.cat([torch.arange(starts[i], starts[i] + patches[i]) for i in which])
    return pixel_values[rows], image_grid_thw_n3[which]


def image_features(model: Qwen2VLForConditionalGeneration, pixel_values: torch.Tensor,
                   image_grid_thw_n3: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One vision-tower pass over all the images: each image's merged features [its tokens, hidden]."""
    inner = hf_model(model).model
    visual = inner.visual
    pixels = pixel_values.to(visual.device, visual.dtype)
    out = inner.get_image_features(pixels, image_grid_thw_n3.to(visual.device), return_dict=True)
    return out.pooler_output


def vlm_inputs(model: Qwen2VLForConditionalGeneration, batch: VisionBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's ``inputs_embeds`` [B, T, hidden] (image features over the image tokens) and M-RoPE
    ``position_ids`` [3, B, T] for ``batch``, the vision tower run once per distinct image."""
    model = hf_model(model)
    device = model.device
    input_ids_bt = batch.input_ids_bt.to(device)
    embeds_bth = model.get_input_embeddings()(input_ids_bt)
    image_token_id, merge = model.config.image_token_id, model.config.vision_config.spatial_merge_size
    order = [i for row in batch.row_images for i in row]
    grids = None
    if order:
        features = image_features(model, batch.pixel_values, batch.image_grid_thw_n3)
        placed = torch.cat([features[i] for i in order]).to(embeds_bth.dtype)
        image_bt = input_ids_bt == image_token_id
        if int(image_bt.sum()) != placed.shape[0]:
            raise ValueError(f"{int(image_bt.sum())} image tokens in the batch but its rows' images have "
                             f"{placed.shape[0]} features")
        embeds_bth = embeds_bth.masked_scatter(image_bt.unsqueeze(-1), placed)
        grids = batch.image_grid_thw_n3[order]
    positions, _ = mrope_position_ids(batch.input_ids_bt, batch.attention_mask_bt, grids, image_token_id, merge)
    return embeds_bth, positions.to(device)


def vlm_token_logprobs(model: Qwen2VLForConditionalGeneration, batch: VisionBatch,
                       temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs [B, T] (float32, differentiable, vision tower included) of ``batch.input_ids_bt``:
    column t is log p(token t | tokens < t, images); column 0 and padding are 0. The caller keeps the response
    columns (``TrainBatch.loss_mask_bt``)."""
    embeds_bth, positions = vlm_inputs(model, batch)
    mask_bt = batch.attention_mask_bt.to(embeds_bth.device)
    out = model.get_decoder()(inputs_embeds=embeds_bth, attention_mask=mask_bt, position_ids=positions,
                              use_cache=False)
    head = model.get_output_embeddings()
    targets_bt = batch.input_ids_bt.to(embeds_bth.device)[:, 1:]
    logp_bt, _ = chunked_head_logprobs(out.last_hidden_state[:, :-1], head.weight, head.bias, targets_bt, temperature)
    return torch.nn.functional.pad(logp_bt, (1, 0)).masked_fill(~mask_bt.bool(), 0.0)


# ---- contexts built turn by turn (agent episodes, the endpoint) ----------------------------------------------

def image_token_counts(processor: ProcessorMixin, images: list[Any], where: str = "images") -> list[int]:
    """How many ``<|image_pad|>`` tokens each image becomes (its merged patch blocks), from its size through the
    image processor's own resize rule, as ``prompt_ids`` counts them (no pixel values computed)."""
    images_of = processor.image_processor
    loaded = [load_image(im, f"{where}, image {k}") for k, im in enumerate(images)]
    return [images_of.get_number_of_image_patches(im.height, im.width, {}) // images_of.merge_size**2
            for im in loaded]


def widen_image_pads(processor: ProcessorMixin, rendered: str, images: list[Any], where: str = "text") -> str:
    """``rendered`` (chat-template text with one ``<|image_pad|>`` per image) with the k-th placeholder widened to
    the k-th image's token count, as ``prompt_ids`` widens a prompt's: the text an agent episode's observation or
    the endpoint's new messages append. A placeholder count that differs from ``len(images)`` is an error."""
    pieces = rendered.split(IMAGE_PAD)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"{where}: the template rendered {len(pieces) - 1} image placeholders for {len(images)} "
                         "images")
    counts = image_token_counts(processor, images, where)
    return pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:]))


def vision_token_ids(tokenizer) -> frozenset[int]:
    """The ids of the vision markers (``VISION_TOKENS``) of a tokenizer that carries a vision-language processor
    (``attach_processor``); empty for a text model, whose tokenizer may hold the same strings harmlessly. A policy
    that samples one of them makes its context's image-token count disagree with its pictures."""
    if processor_of(tokenizer) is None:
        return frozenset()
    ids = {tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    return frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)
