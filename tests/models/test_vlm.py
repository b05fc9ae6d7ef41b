"""The tiny vision-language model (models/vlm.py): its size, the processor's image tokens counted by hand, the chat
template over OpenAI-style parts, save/load, M-RoPE positions against transformers' own, and log-probs with
images against a plain Hugging Face forward, with one vision-tower pass per distinct image."""

import pytest
import torch
from PIL import Image, ImageDraw

from tidal.models import vlm
from tidal.utils.images import ImageError, image_part, to_png_bytes

TEXT = "how many squares?"


@pytest.fixture(scope="module")
def processor():
    return vlm.build_processor(vlm.VLMConfig())


@pytest.fixture(scope="module")
def model(processor):
    return vlm.build_vlm(vlm.VLMConfig(), processor)


def picture(size: int, color: str = "red", at: int = 5) -> Image.Image:
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).rectangle([at, at, at + 9, at + 9], fill=color)
    return image


def test_tiny_model_size_and_special_tokens(model, processor):
    num_params = sum(p.numel() for p in model.parameters())
    assert 300_000 < num_params < 2_000_000, num_params
    tok = processor.tokenizer
    for token in (*vlm.VISION_TOKENS, "<|im_start|>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(token) != tok.pad_token_id, token
        assert tok.tokenize(token) == [token]  # one token each, never split into characters
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.text_config.vocab_size == len(tok)


@pytest.mark.parametrize("side, grid, num_tokens", [(56, 4, 4), (112, 8, 16)])
def test_image_token_count_by_hand(processor, side, grid, num_tokens):
    """(side / 14)^2 patches, merged 2x2: a 56x56 image is (56/14)^2 / 2^2 = 4 tokens, 112x112 is 16."""
    enc = vlm.encode_prompt(processor, TEXT, [picture(side)])
    assert enc["image_grid_thw"].tolist() == [[1, grid, grid]]
    assert enc["pixel_values"].shape == (grid * grid, 3 * 2 * 14 * 14)  # 2 frames: a still image is doubled in time
    text = processor.tokenizer.decode(enc["input_ids"][0])
    expected = ("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * num_tokens + "<|vision_end|>" + TEXT
                + "<|im_end|>\n<|im_start|>assistant\n")
    assert text == expected
    image_mask = enc["input_ids"][0] == processor.image_token_id
    assert int(image_mask.sum()) == num_tokens
    assert enc["mm_token_type_ids"][0].tolist() == image_mask.long().tolist()


def test_chat_template_renders_openai_parts(processor):
    """image_url parts (data URLs), image parts holding a PIL image, bare image parts filled from ``images``, and
    string contents render as Qwen2-VL's template does; the same pixels whatever form the image came in."""
    red, blue = picture(56, "red"), picture(112, "blue", at=40)
    by_url = [{"role": "user", "content": [image_part(red), {"type": "text", "text": "a"},
                                           {"type": "image", "image": to_png_bytes(blue)},
                                           {"type": "text", "text": "b"}]},
              {"role": "assistant", "content": "2"}]
    bare = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "2"}]
    a = vlm.encode_messages(processor, by_url, add_generation_prompt=False)
    b = vlm.encode_messages(processor, bare, images=[red, blue], add_generation_prompt=False)
    for key in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert torch.equal(a[key], b[key]), key
    expected = ("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>a<|vision_start|>"
                + "<|image_pad|>" * 16 + "<|vision_end|>b<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n")
    assert processor.tokenizer.decode(a["input_ids"][0]) == expected
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[2\]: an image part with no image"):
        vlm.encode_messages(processor, bare, images=[red])
    with pytest.raises(ImageError, match=r"messages\[0\]\.content\[0\]: unreadable image"):
        vlm.encode_messages(processor, [{"role": "user", "content": [{"type": "image", "image": b"not a png"}]}])


def test_save_load_round_trip(model, processor, tmp_path):
    vlm.save(model, processor, tmp_path / "vlm")
    loaded, loaded_processor = vlm.load(tmp_path / "vlm")
    again = vlm.ImageTextProcessor.from_pretrained(tmp_path / "vlm", local_files_only=True)
    enc = vlm.encode_prompt(processor, TEXT, [picture(56)])
    for other in (loaded_processor, again):
        got = vlm.encode_prompt(other, TEXT, [picture(56)])
        assert all(torch.equal(enc[k], got[k]) for k in enc)
    assert loaded_processor.image_processor.size.longest_edge == 112 * 112
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, loaded(**enc).logits)


# ---- M-RoPE ------------------------------------------------------------------------------------------------------

def test_mrope_positions_by_hand(model):
    """Text 0..3, a 2x2 image at 4 (temporal 4,4,4,4; rows 4,4,5,5; columns 4,5,4,5), text resumes at 4 + 2 = 6."""
    img = model.config.image_token_id
    ids = [1, 2, 3, 4, img, img, img, img, 5, 6]
    pos, delta = vlm.mrope_positions(ids, torch.tensor([[1, 4, 4]]), img)
    assert pos.tolist() == [[0, 1, 2, 3, 4, 4, 4, 4, 6, 7], [0, 1, 2, 3, 4, 4, 5, 5, 6, 7],
                            [0, 1, 2, 3, 4, 5, 4, 5, 6, 7]]
    assert delta == 7 + 1 - 10
    with pytest.raises(ValueError, match="3 image tokens in the sequence but its 1 image grids need 4"):
        vlm.mrope_positions(ids[:7] + [5, 6], torch.tensor([[1, 4, 4]]), img)


def _rows(processor, images_per_row):
    """Right-padded prompt + response rows (``TrainBatch``'s layout), their grids in row order, and the
    processor's ``mm_token_type_ids``."""
    encs = [vlm.encode_prompt(processor, TEXT, images) for images in images_per_row]
    rows = [torch.cat([e["input_ids"][0], torch.tensor([5 + i, 6, 7][: 1 + i % 3])]) for i, e in enumerate(encs)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    grids = [e["image_grid_thw"] for e in encs if "image_grid_thw" in e]
    grids = torch.cat(grids) if grids else None
    return ids, mask, grids, (ids == processor.image_token_id).long()


def test_mrope_equals_transformers_get_rope_index(model, processor):
    """Prompts with 0, 1 and 2 images (of two sizes), text continuing after them, padded right and left."""
    ids, mask, grids, mm = _rows(processor, [[], [picture(56)], [picture(56), picture(112)], [picture(112)]])
    ref, ref_delta = model.model.get_rope_index(ids, mm, grids, attention_mask=mask)
    pos, delta = vlm.mrope_position_ids(ids, mask, grids, model.config.image_token_id)
    assert torch.equal(pos, ref) and torch.equal(delta, ref_delta)
    # each image takes (its tokens - its grid side) fewer positions than tokens
    assert delta[0].item() == 0 and delta[2].item() == -((4 - 2) + (16 - 4))
    lengths = mask.sum(1)
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(mask)  # the same rows, left-padded
    for i, n in enumerate(lengths.tolist()):
        left_ids[i, ids.shape[1] - n:], left_mask[i, ids.shape[1] - n:] = ids[i, :n], 1
    ref, ref_delta = model.model.get_rope_index(left_ids, (left_ids == processor.image_token_id).long(), grids,
                                                attention_mask=left_mask)
    pos, delta = vlm.mrope_position_ids(left_ids, left_mask, grids, model.config.image_token_id)
    assert torch.equal(pos, ref) and torch.equal(delta, ref_delta)


def test_generated_tokens_continue_at_index_plus_delta(model, processor):
    """A prompt's delta places the tokens generated after it (i + delta), as the whole sequence's positions
    do and as transformers' decode step does from its cache (``compute_3d_position_ids``)."""
    enc = vlm.encode_prompt(processor, TEXT, [picture(56), picture(112)])
    prompt = enc["input_ids"][0]
    _, delta = vlm.mrope_positions(prompt, enc["image_grid_thw"], model.config.image_token_id)
    response = torch.tensor([5, 6, 7, 8])
    whole, _ = vlm.mrope_positions(torch.cat([prompt, response]), enc["image_grid_thw"], model.config.image_token_id)
    assert torch.equal(whole[:, len(prompt):], vlm.decode_positions(len(prompt), 4, delta))
    with torch.no_grad():
        out = model(**enc, use_cache=True)
        step = model.model.compute_3d_position_ids(
            input_ids=response[None, :1], inputs_embeds=model.get_input_embeddings()(response[None, :1]),
            cache=out.cache)
    assert torch.equal(step[:, 0], vlm.decode_positions(len(prompt), 1, delta))


# ---- log-probs with images --------------------------------------------------------------------------------------

def _reference_logprobs(model, ids, mask, pixel_values, grids):
    """A plain Hugging Face forward (every row's images through the vision tower) and its log-softmax."""
    mm = (ids == model.config.image_token_id).long()
    logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixel_values, image_grid_thw=grids,
                   mm_token_type_ids=mm).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


class PatchCounter:
    """Counts vision-tower calls and the patches they embed."""

    def __init__(self, model):
        self.calls, self.patches = 0, 0
        self.handle = model.model.visual.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        self.patches += args[0].shape[0]


def test_logprobs_equal_hf_forward_with_one_vision_pass_per_distinct_image(model, processor):
    """Two groups of G = 3 samples (prompt A: one image; prompt B: two images, one of them A's) plus a text-only
    row: log-probs and gradients equal a plain HF forward's, and the vision tower embeds each of the 3 distinct
    images once (16 + 64 + 16 patches), where the HF forward embeds every row's images (7 images)."""
    model.float().train()
    red, blue, green = picture(56, "red"), picture(112, "blue", at=40), picture(56, "green", at=30)
    distinct = [red, blue, green]
    rows_images = [[0], [0], [0], [1, 2], [1, 2], [1, 2], []]
    ids, mask, grids, _ = _rows(processor, [[distinct[i] for i in row] for row in rows_images])
    pixel_values, distinct_grids = vlm.image_batch(processor, distinct)
    batch = vlm.VisionBatch(ids, mask, pixel_values, distinct_grids, rows_images)
    per_row_pixels = torch.cat([vlm.image_batch(processor, [distinct[i]])[0] for row in rows_images for i in row])

    counter = PatchCounter(model)
    try:
        ours = vlm.vlm_token_logprobs(model, batch)
        assert (counter.calls, counter.patches) == (1, 16 + 64 + 16)
        counter.calls = counter.patches = 0
        ref = _reference_logprobs(model, ids, mask, per_row_pixels, grids)
        assert (counter.calls, counter.patches) == (1, 3 * 16 + 3 * (64 + 16))
    finally:
        counter.handle.remove()
    real = mask.bool()
    real[:, 0] = False
    torch.testing.assert_close(ours[real], ref[real], rtol=0, atol=1e-5)
    assert (ours[~mask.bool()] == 0).all() and (ours[:, 0] == 0).all()

    weights = torch.rand_like(ours) * real  # any loss over the scored tokens
    grads = []
    for logp in (ours, ref):
        model.zero_grad()
        (logp * weights).sum().backward(retain_graph=False)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("visual" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_logprobs_batch_miscounted_images_is_an_error(model, processor):
    ids, mask, _, _ = _rows(processor, [[picture(56)]])
    pixel_values, grids = vlm.image_batch(processor, [picture(112)])  # 16 features for 4 image tokens
    with pytest.raises(ValueError, match="4 image tokens in the batch but its rows' images have 16 features"):
        vlm.vlm_token_logprobs(model, vlm.VisionBatch(ids, mask, pixel_values, grids, [[0]]))


def test_logprobs_equal_hf_generate_scores(model, processor):
    """The decode side: HF ``generate`` (prefill with pixels, then cached steps at i + delta) on two left-padded
    prompts (one image; two images of two sizes) scores its sampled tokens as ``vlm_token_logprobs`` does on the
    same rows right-padded, which is what engine/trainer parity will rest on. Sampled (raw logits kept), so the
    tokens vary."""
    model.eval()
    images = [[picture(56)], [picture(112, "blue"), picture(56, "green", at=30)]]
    texts = [processor.apply_chat_template(vlm.user_message(TEXT, len(im)), add_generation_prompt=True,
                                           tokenize=False) for im in images]
    enc = processor(text=texts, images=[im for row in images for im in row], padding=True, return_tensors="pt")
    assert (enc["attention_mask"][:, 0] == 0).any()  # left-padded
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        out = model.generate(**enc, max_new_tokens=6, do_sample=True, top_k=0, top_p=1.0, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=processor.tokenizer.pad_token_id)
    width = enc["input_ids"].shape[1]
    new = out.sequences[:, width:]
    assert len(set(new.flatten().tolist())) > 3
    gen_logp = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)
    rows = [torch.cat([enc["input_ids"][b][enc["attention_mask"][b].bool()], new[b]]) for b in range(2)]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    pixel_values, grids = vlm.image_batch(processor, [im for row in images for im in row])
    batch = vlm.VisionBatch(ids, mask, pixel_values, grids, [[0], [1, 2]])
    with torch.no_grad():
        ours = vlm.vlm_token_logprobs(model, batch)
    eos = processor.tokenizer.eos_token_id
    for b, row in enumerate(rows):
        prompt_len = len(row) - new.shape[1]
        stop = (new[b] == eos).nonzero()
        keep = int(stop[0]) + 1 if len(stop) else new.shape[1]  # after EOS generate pads; nothing is sampled
        torch.testing.assert_close(ours[b, prompt_len:prompt_len + keep], gen_logp[b, :keep], rtol=0, atol=1e-5)


def test_image_subset_and_token_counts(processor):
    """Images' patches are concatenated in order: a subset takes each chosen image's own rows and grid."""
    small, large, other = picture(56, "red"), picture(112, "blue", at=40), picture(56, "green", at=30)
    pixel_values, grids = vlm.image_batch(processor, [small, large, other])
    assert vlm.image_tokens(grids) == [4, 16, 4]
    sub_pixels, sub_grids = vlm.image_subset(pixel_values, grids, [2, 1])
    alone = [vlm.image_batch(processor, [image]) for image in (other, large)]
    assert torch.equal(sub_pixels, torch.cat([p for p, _ in alone])) and torch.equal(sub_grids, grids[[2, 1]])


def test_logprobs_through_a_lora_wrapper_equal_the_base(model, processor):
    """``hf_model`` unwraps PEFT, so a LoRA policy (B = 0: the base at step 0) scores images as its base does."""
    import copy

    from tidal.models import lora

    model.float().eval()
    ids, mask, grids, _ = _rows(processor, [[picture(56)], []])
    pixel_values, _ = vlm.image_batch(processor, [picture(56)])
    batch = vlm.VisionBatch(ids, mask, pixel_values, grids, [[0], []])
    wrapped = lora.wrap(copy.deepcopy(model), lora.LoraConfig(rank=2))
    with torch.no_grad():
        torch.testing.assert_close(vlm.vlm_token_logprobs(wrapped, batch), vlm.vlm_token_logprobs(model, batch),
                                   rtol=0, atol=1e-6)
