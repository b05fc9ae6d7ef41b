"""count_squares (tasks/visual.py): pictures checked pixel by pixel, a deterministic split with no held-out picture
trained on, the text rendering of the same problems, exact-match rewards through the reward pool, and the prompt
through the tiny vision-language model's processor."""

import re

import numpy as np
import pytest

from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.tasks.visual import COLORS, QUESTION, render_squares, squares_text
from tidal.utils.images import load_image


def _task(num_eval=100, seed=0, **params):
    params.setdefault("num_problems", 800)
    return TASKS.get("count_squares")(TaskConfig(name="count_squares", num_eval=num_eval, seed=seed, params=params))


def test_picture_pixels_by_hand():
    """56 px / 6 cells = 9 px cells, squares of 6 px (2/3) centred: cell (col, row) spans x = 1 + 9 col + 1 .. +5."""
    image = np.asarray(render_squares(((0, 0), (5, 2)), (0, 2)))
    assert image.shape == (56, 56, 3)
    red, blue, white = COLORS[0], COLORS[2], (255, 255, 255)
    assert tuple(image[2, 2]) == red and tuple(image[7, 7]) == red  # rows/columns 2..7 of cell (0, 0)
    assert tuple(image[1, 1]) == white and tuple(image[8, 8]) == white
    assert tuple(image[2 + 18, 2 + 45]) == blue and tuple(image[7 + 18, 7 + 45]) == blue  # cell (5, 2): y 20.., x 47..
    coloured = (image != 255).any(-1)
    assert coloured.sum() == 2 * 6 * 6  # two 6x6 squares and nothing else


def test_prompts_answers_and_images():
    task = _task()
    for i in range(50):
        p = task.train_prompt(i)
        assert p.text == QUESTION and p.answer == str(len(p.meta["cells"])) and p.answer in "1234"
        image = load_image(p.meta["images"][0], f"prompt {p.uid}")
        assert image.size == (56, 56)
        squares = (np.asarray(image) != 255).any(-1).sum() // 36  # each square is 6x6 coloured pixels
        assert squares == int(p.answer)


def test_deterministic_split_with_no_held_out_picture_trained_on():
    task, again, other = _task(), _task(), _task(seed=1)
    train = [task.train_prompt(i) for i in range(task.num_train)]
    assert [p.meta for p in train] == [again.train_prompt(i).meta for i in range(task.num_train)]
    assert [p.meta for p in task.eval_prompts()] == [p.meta for p in again.eval_prompts()]
    assert [p.meta for p in other.eval_prompts()] != [p.meta for p in task.eval_prompts()]
    held_out = {p.meta["images"][0] for p in task.eval_prompts()}
    assert len(held_out) == 100 and not held_out & {p.meta["images"][0] for p in train}
    assert task.num_train == 144 + 3 * 200 - 100  # 800 / 4 counts asked for, one square has 144 problems
    counts = np.bincount([int(p.answer) for p in train + task.eval_prompts()], minlength=5)[1:]
    assert counts.tolist() == [144, 200, 200, 200]  # one square has only 36 cells x 4 colours = 144 problems


def test_text_rendering_is_the_same_problems():
    pictures, texts = _task(), _task(render="text")
    for i in range(20):
        a, b = pictures.train_prompt(i), texts.train_prompt(i)
        assert a.meta["cells"] == b.meta["cells"] and a.answer == b.answer and "images" not in b.meta
        assert b.text == squares_text(tuple(map(tuple, a.meta["cells"])))
    assert squares_text(((1, 2), (4, 0))) == "squares at (1,2),(4,0): how many?"


@pytest.mark.parametrize("params, message", [
    ({"render": "video"}, "params.render='video' must be one of"),
    ({"max_count": 12}, "params.max_count=12 must be in"),
    ({"num_problems": 50}, "params.num_problems=50 must exceed num_eval=100"),
    ({"size": 10}, "need integers with size >= 3 * grid"),
])
def test_bad_params_are_one_error(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _task(**params)


def test_exact_match_reward_through_the_pool():
    """Prompts with their picture in meta travel to a reward worker process and score by exact match."""
    task = _task()
    prompts = [task.train_prompt(i) for i in range(4)]
    items = [(p.answer, p) for p in prompts] + [(" " + p.answer + "\n", p) for p in prompts]
    items += [(str(int(p.answer) % 4 + 1), p) for p in prompts]  # a wrong count
    pool = RewardPool(build_reward("exact_match"), RewardConfig(num_workers=1, timeout_s=30))
    try:
        rewards = [r for r, _ in pool.score(items)]
    finally:
        pool.close()
    assert rewards == [1.0] * 8 + [0.0] * 4


def test_prompt_through_the_vlm_processor():
    from tidal.models import vlm

    processor = vlm.build_processor(vlm.VLMConfig())
    p = _task().eval_prompts()[0]
    enc = vlm.encode_prompt(processor, p.text, p.meta["images"], where=f"prompt {p.uid}")
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((enc["input_ids"] == processor.image_token_id).sum()) == 4
    text = _task(render="text").eval_prompts()[0]
    enc = vlm.encode_prompt(processor, text.text, [])
    assert "pixel_values" not in enc and processor.tokenizer.decode(enc["input_ids"][0]).count(text.text) == 1
