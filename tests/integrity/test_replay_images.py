"""The SDC guard keeps each step's batch on disk for replays (``integrity/replay.py``); a vision-language batch's
images (``TrainBatch.images``) must come back whole through ``torch.load(weights_only=True)`` (issue 54)."""

import torch

from tidal.algo.config import AlgoConfig
from tidal.integrity.replay import load_batch, save_batch
from tidal.models import vlm
from tidal.tasks.visual import render_squares
from tidal.train.batch import build_train_batch
from tidal.types import Group, Prompt, Trajectory


def test_a_batch_with_images_round_trips(tmp_path):
    processor = vlm.build_processor(vlm.VLMConfig())
    prompt = Prompt("p", "how many squares?", "1", {"images": [render_squares(((2, 3),), (1,))]})
    ids = vlm.prompt_ids(processor, prompt.text, prompt.images)
    group = Group(prompt, [Trajectory("p", i, ids, [20 + i, 2], [-1.0, -1.0], [0, 0], "stop", reward=float(i))
                           for i in range(2)])
    batch, _ = build_train_batch([group], AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    save_batch(batch, tmp_path / "step.pt")
    back = load_batch(tmp_path / "step.pt")
    assert back.images.row_images == batch.images.row_images == [[0], [0]]
    for name in ("pixel_values", "image_grid_thw_n3", "feature_index_bt", "position_ids_3bt"):
        assert torch.equal(getattr(back.images, name), getattr(batch.images, name))
    assert torch.equal(back.input_ids_bt, batch.input_ids_bt)

