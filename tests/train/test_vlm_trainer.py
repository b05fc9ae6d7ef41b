"""The trainer on vision-language batches (train/vision.py): a batch carries each distinct image once with its
tokens' features and M-RoPE positions; a step's gradients equal a hand-built loss over ``vlm_token_logprobs`` in
the padded, micro-batched, packed and prefix-shared layouts; the vision tower runs once per distinct image per
pass; miscounted images and tries that would share different pictures are errors."""

import copy

import pytest
import torch
from PIL import Image, ImageDraw

from tidal.algo import ADVANTAGES, bind
from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models import lora, vlm
from tidal.optim import OptimConfig
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.train.vision import with_images
from tidal.types import Group, Prompt, Trajectory
from tidal.utils.images import to_data_url

TEXT = "how many squares?"


@pytest.fixture(scope="module")
def processor():
    return vlm.build_processor(vlm.VLMConfig())


@pytest.fixture(scope="module")
def base(processor):
    return vlm.build_vlm(vlm.VLMConfig(), processor)


def picture(color: str, at: int = 5, size: int = 56) -> str:
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).rectangle([at, at, at + 9, at + 9], fill=color)
    return to_data_url(image)


def _ids(processor, text):
    return list(processor.tokenizer.encode(text))


def _groups(processor, model, image_sets, responses, rewards):
    """One group per entry of ``image_sets`` (a list of data URLs; empty: a text prompt), its samples' responses
    given as text, behaviour log-probs the model's own (so every ratio starts at 1; no model: zeros)."""
    groups = []
    for g, (images, texts, rs) in enumerate(zip(image_sets, responses, rewards)):
        prompt = Prompt(f"p{g}", TEXT, "2", {"images": images} if images else {})
        ids = vlm.encode_prompt(processor, TEXT, images)["input_ids"][0].tolist()
        trajs = [Trajectory(prompt.uid, i, ids, _ids(processor, t), [0.0] * len(_ids(processor, t)),
                            [0] * len(_ids(processor, t)), "stop", reward=r) for i, (t, r) in enumerate(zip(texts, rs))]
        groups.append(Group(prompt, trajs))
    if model is None:
        return groups
    batch, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    with torch.no_grad():
        logp = vlm_logp(model, batch)
    for row, t in enumerate(t for g in groups for t in g.trajectories):
        p = len(t.prompt_ids)
        t.logprobs = logp[row, p:p + len(t.token_ids)].tolist()
    return groups


def vlm_logp(model, batch):
    """The models/vlm.py reference: every row's images from the batch's distinct images, one padded forward."""
    images = batch.images
    return vlm.vlm_token_logprobs(model, vlm.VisionBatch(batch.input_ids_bt, batch.attention_mask_bt,
                                                         images.pixel_values, images.image_grid_thw_n3,
                                                         images.row_images))


IMAGES = [[picture("red")], [picture("blue", at=30)], []]  # two groups with one image each, one text group
RESPONSES = [["2<|im_end|>", "13<|im_end|>"], ["4<|im_end|>", "1<|im_end|>", "22<|im_end|>"], ["3<|im_end|>", "9"]]
REWARDS = [[1.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0]]


def test_batch_carries_each_distinct_image_once_with_positions_and_features(processor, base):
    same = picture("green")
    groups = _groups(processor, None, [[same], [same], [picture("red")]],
                     [["1<|im_end|>", "2"], ["3", "4"], ["<|image_pad|>5", "6"]], [[1.0, 0.0]] * 3)
    batch, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    images = batch.images
    assert images.image_grid_thw_n3.tolist() == [[1, 4, 4], [1, 4, 4]]  # the green picture of two prompts: once
    assert images.pixel_values.shape[0] == 2 * 16
    assert images.row_images == [[0], [0], [0], [0], [1], [1]]
    image_id = processor.image_token_id
    for b, t in enumerate(t for g in groups for t in g.trajectories):
        p = len(t.prompt_ids)
        at = [i for i, x in enumerate(t.prompt_ids) if x == image_id]
        assert images.feature_index_bt[b, at].tolist() == [4 * images.row_images[b][0] + k for k in range(4)]
        assert (images.feature_index_bt[b, p:] == -1).all()  # a sampled image-pad id is text (row 4)
        pos, delta = vlm.mrope_positions(t.prompt_ids, images.image_grid_thw_n3[images.row_images[b]], image_id)
        n = len(t.token_ids)
        expected = torch.cat([pos, vlm.decode_positions(p, n, delta)], 1)
        assert torch.equal(images.position_ids_3bt[:, b, :p + n], expected)
    plain, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id)
    assert plain.images is None and torch.equal(plain.input_ids_bt, batch.input_ids_bt)  # no processor: text only
    assert with_images(base, plain, torch.arange(2), 10) is base  # the text path gets the model itself


def test_miscounted_images_are_an_error_naming_the_prompt(processor, base):
    prompt = Prompt("p7", TEXT, "2", {"images": [picture("red")]})
    ids = _ids(processor, "<|im_start|>user\n" + TEXT + "<|im_end|>\n<|im_start|>assistant\n")  # no image tokens
    group = Group(prompt, [Trajectory("p7", 0, ids, [5], [0.0], [0], "stop", reward=1.0),
                           Trajectory("p7", 1, ids, [6], [0.0], [0], "stop")])
    with pytest.raises(ValueError, match="prompt p7, sample 0: 0 image tokens in the sequence but its 1 image grids"):
        build_train_batch([group], AlgoConfig(), processor.tokenizer.pad_token_id, processor)


class Grads:
    """A trainer observer keeping the gradients of the step's (one) minibatch, before clipping."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def after_backward(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def after_optimizer(self):
        pass


def _reference_grads(model, batch):
    """PPO-clip at ratio 1 (behaviour = the model's own log-probs), GRPO advantages, token-mean: the loss is
    -sum(A_b exp(logp - behav) mask) / sum(mask), with logp from ``vlm_token_logprobs``."""
    model.zero_grad(set_to_none=True)
    logp = vlm_logp(model, batch)
    adv_b = bind(ADVANTAGES["grpo"], AlgoConfig())(batch.rewards_b, batch.group_index_b)
    mask = batch.loss_mask_bt
    loss = -(adv_b[:, None] * torch.exp(logp - batch.behav_logp_bt) * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


LAYOUTS = {
    "padded": TrainerConfig(),
    "micro": TrainerConfig(micro_batch_tokens=80),
    "packed": TrainerConfig(packing=True, pack_tokens=160),
    "packed_micro": TrainerConfig(packing=True, pack_tokens=160, micro_batch_tokens=80),
    "tries": TrainerConfig(share_prefixes=True, pack_tokens=160),
    "tries_micro": TrainerConfig(share_prefixes=True, pack_tokens=160, micro_batch_tokens=40),
    "head_loss": TrainerConfig(packing=True, pack_tokens=160, head_tokens="loss"),
    "packed_block": TrainerConfig(packing=True, pack_tokens=160, packed_attention="block"),  # FlexAttention
    "tries_block": TrainerConfig(share_prefixes=True, pack_tokens=160, packed_attention="block"),
}
SLOW = ("packed_block", "tries_block")  # FlexAttention compiles for ~10 s on a CPU: passed once, run with -m slow


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in LAYOUTS])
def test_step_gradients_equal_a_hand_built_loss(processor, base, layout):
    """Two groups with an image each and a text-only group: every layout's step has the gradients (vision tower
    included) of the hand-built loss over the padded reference, and one vision pass per distinct image per pass."""
    model = copy.deepcopy(base)
    groups = _groups(processor, model, IMAGES, RESPONSES, REWARDS)
    batch, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    expected = _reference_grads(model, batch)
    trainer = Trainer(model, AlgoConfig(), OptimConfig(lr=1e-3, grad_clip=1e9), LAYOUTS[layout])
    seen = Grads(model)
    trainer.observers.append(seen)
    calls = []
    hook = model.model.visual.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    metrics = trainer.step(batch)
    hook.remove()
    assert metrics["train/logp_mismatch_mean"] < 1e-5  # the trainer scores the samples as the reference did
    assert set(seen.grads) == set(expected)
    assert any(n.startswith("model.visual") for n in expected)
    for name, g in expected.items():
        assert torch.allclose(seen.grads[name], g, rtol=1e-4, atol=1e-6), (layout, name)
    micros = trainer._micro_batches(batch, torch.arange(batch.num_sequences))
    per_pass = [sorted({i for r in m.tolist() for i in batch.images.row_images[r]}) for m in micros]
    assert calls == [16 * len(p) for p in per_pass if p]  # each pass embeds its own distinct images, once each
    if layout == "padded":
        assert calls == [32]


def test_tries_refuse_to_share_different_pictures_behind_the_same_tokens(processor, base):
    model = copy.deepcopy(base)
    groups = _groups(processor, model, IMAGES[:2], [["1", "2"], ["3", "4"]], [[1.0, 0.0], [1.0, 0.0]])
    batch, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    batch.group_index_b = torch.zeros_like(batch.group_index_b)  # one "group" showing two pictures
    trainer = Trainer(model, AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig(share_prefixes=True))
    with pytest.raises(ValueError, match="trainer.share_prefixes: sequences through one trie node show different"):
        trainer.step(batch)


def test_lora_on_the_language_model_with_the_vision_tower_frozen_or_adapted(processor, base):
    frozen = lora.wrap(copy.deepcopy(base), lora.LoraConfig(rank=2))
    names = [n for n, p in frozen.named_parameters() if p.requires_grad]
    assert names and not any(".visual." in n for n in names)
    assert any("language_model" in n for n in names)
    adapted = lora.wrap(copy.deepcopy(base), lora.LoraConfig(rank=2, vision="lora"))
    assert any(".visual." in n for n, p in adapted.named_parameters() if p.requires_grad)
    with pytest.raises(ConfigError, match="model.lora.vision must be frozen or lora"):
        lora.validate(lora.LoraConfig(rank=2, vision="trained"))
    for model in (frozen, adapted):  # a LoRA step on a VLM batch moves only the adapters
        groups = _groups(processor, model, IMAGES, RESPONSES, REWARDS)
        batch, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id, processor)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = Trainer(model, AlgoConfig(kl_coef=0.1), OptimConfig(lr=1e-2), TrainerConfig(packing=True))
        metrics = trainer.step(batch)
        assert metrics["train/logp_mismatch_mean"] < 1e-5
        assert abs(metrics["algo/kl"]) < 1e-6  # the reference (adapters off, images too) is the policy at B = 0
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert moved and moved <= {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("rank", [0, 2])
def test_checkpoint_and_resume_continue_as_if_uninterrupted(processor, base, tmp_path, rank):
    """A VLM trainer's checkpoint (the processor saved as its tokenizer) loads back as a model and processor, and
    a trainer resumed from it takes the same next step as the one that went on (full weights and LoRA). The full
    weights are on disk in the Hub's Qwen2-VL layout (``visual.*``, ``model.layers.*``), which the resume reads
    back through the writing class's own weight conversions (``checkpoint.in_model_layout``)."""
    from tidal.train.checkpoint import TrainingState

    def policy():
        model = copy.deepcopy(base)
        return lora.wrap(model, lora.LoraConfig(rank=rank)) if rank else model

    def trainer_of(model):
        return Trainer(model, AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig(packing=True))

    model = policy()
    batch, _ = build_train_batch(_groups(processor, model, IMAGES, RESPONSES, REWARDS), AlgoConfig(),
                                 processor.tokenizer.pad_token_id, processor)
    trainer = trainer_of(model)
    trainer.step(batch)
    path = trainer.save_checkpoint(tmp_path, processor, TrainingState(1, trainer.version, 3, {}))
    if not rank:  # the checkpoint is a Qwen2-VL folder with its processor
        loaded, loaded_processor = vlm.load(path)
        enc = vlm.encode_prompt(processor, TEXT, IMAGES[0])
        assert torch.equal(vlm.encode_prompt(loaded_processor, TEXT, IMAGES[0])["input_ids"], enc["input_ids"])
        assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), model.parameters()))
    resumed = trainer_of(policy())
    assert resumed.load_checkpoint(path).next_group == 3 and resumed.version == 1
    trainer.step(batch)
    resumed.step(batch)
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_a_full_weight_checkpoint_is_a_qwen2_vl_folder_vlm_load_reads_as_trained(processor, base, tmp_path):
    """The model folder of a full-weight checkpoint is a plain Qwen2-VL folder: the file holds the Hub's names (what
    vLLM and other tools read), ``vlm.load`` gives back every weight under the in-memory names, equal to the
    trained ones, and ``read_checkpoint`` (the resume's read) gives the same names and values."""
    from safetensors import safe_open

    from tidal.train.checkpoint import TrainingState, read_checkpoint

    model = copy.deepcopy(base)
    batch, _ = build_train_batch(_groups(processor, model, IMAGES, RESPONSES, REWARDS), AlgoConfig(),
                                 processor.tokenizer.pad_token_id, processor)
    trainer = Trainer(model, AlgoConfig(), OptimConfig(lr=1e-3), TrainerConfig(packing=True))
    trainer.step(batch)
    path = trainer.save_checkpoint(tmp_path, processor, TrainingState(1, trainer.version, 3, {}))
    with safe_open(path / "model.safetensors", "pt") as f:
        on_disk = set(f.keys())
    assert any(k.startswith("visual.") for k in on_disk) and not any(k.startswith("model.visual.") for k in on_disk)
    trained = model.state_dict()
    loaded, _ = vlm.load(path)
    assert type(loaded) is type(model)
    got = loaded.state_dict()
    assert set(got) == set(trained)
    for name, t in trained.items():
        assert torch.equal(got[name], t), name
    weights, _ = read_checkpoint(path)
    assert set(weights) == set(trained)
    for name, t in trained.items():
        assert torch.equal(weights[name], t), name


def test_a_sharded_policy_with_images_runs_its_image_view_inside_the_root(processor, base):
    """What the trainer calls for a sharded policy's image pass (``root_of`` of the view) is the root, handed the
    pass's images; the root's forward scores the view it builds over its model as the unsharded view scores.
    The FSDP run itself: ``tests/parallel/test_fsdp_images.py``."""
    from tidal.models.logprobs import token_logprobs
    from tidal.parallel.fsdp import LogprobModule
    from tidal.train.data_parallel import SHARDED_ROOT, root_of

    groups = _groups(processor, None, IMAGES[:1] + IMAGES[2:], [["1", "2"], ["3", "4"]], [[1.0, 0.0]] * 2)
    batch, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    sharded = copy.deepcopy(base)
    calls = []
    root = LogprobModule(sharded)  # unsharded here: the routing, not FSDP
    root.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs.get("images")), with_kwargs=True)
    sharded.__dict__[SHARDED_ROOT] = root  # what parallel/fsdp.py's shard leaves on the model
    width = int(batch.attention_mask_bt.sum(1).max())
    ids, mask = batch.input_ids_bt[:, :width], batch.attention_mask_bt[:, :width]
    for rows in (torch.arange(4), torch.arange(2, 4)):  # with a picture, and text rows only
        view = with_images(sharded, batch, rows, width)
        assert root_of(view) is not None and root_of(view) is not root
        got, _ = root_of(view)(ids[rows], mask[rows])
        images = calls[-1]  # what the root's forward got; a sharded pass always gives the tower a gradient
        assert images is not None and images.all_grads and (images.pixel_values is None) == (int(rows[0]) == 2)
        want, _ = token_logprobs(with_images(base, batch, rows, width), ids[rows], mask[rows])
        assert torch.allclose(got, want, atol=1e-6), rows
    assert with_images(base, batch, torch.arange(2), width).__dict__.get(SHARDED_ROOT) is None  # unsharded: as was
    text, _ = build_train_batch(groups[1:], AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    assert text.images is None and with_images(sharded, text, torch.arange(2), width) is sharded  # the text path
