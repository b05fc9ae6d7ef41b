"""DiLoCo's batch slicing (``parallel/diloco_trainer.rows_of``) with a vision-language batch (issue 54)."""

import copy

import torch

from tidal.algo.config import AlgoConfig
from tidal.models import vlm
from tidal.optim import OptimConfig
from tidal.parallel.diloco_trainer import rows_of
from tidal.tasks.visual import render_squares
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt, Trajectory


def test_a_replicas_rows_keep_their_pictures():
    """DiLoCo gives each replica some rows of a batch (``rows_of``): a vision-language batch's images follow them,
    and the rows score as they do in the whole batch."""
    processor = vlm.build_processor(vlm.VLMConfig())
    model = vlm.build_vlm(vlm.VLMConfig(), processor)
    groups = []
    for uid, cells in (("a", ((2, 3),)), ("b", ((0, 0), (5, 5)))):
        prompt = Prompt(uid, "how many squares?", "1", {"images": [render_squares(cells, (1,) * len(cells))]})
        ids = vlm.prompt_ids(processor, prompt.text, prompt.images)
        groups.append(Group(prompt, [Trajectory(uid, i, ids, [20 + i, 2], [-1.0, -1.0], [0, 0], "stop",
                                                reward=float(i)) for i in range(2)]))
    batch, _ = build_train_batch(groups, AlgoConfig(), processor.tokenizer.pad_token_id, processor)
    part = rows_of(batch, [3, 0])
    assert part.images.row_images == [[1], [0]]
    assert torch.equal(part.images.position_ids_3bt, batch.images.position_ids_3bt[:, [3, 0]])
    trainer = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(lr=1e-4), TrainerConfig())
    assert torch.allclose(trainer._scores(trainer.model, part), trainer._scores(trainer.model, batch)[[3, 0]])
