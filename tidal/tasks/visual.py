"""A synthetic visual task generated locally: how many squares are in the picture?

``count_squares``: a white ``size`` x ``size`` canvas (default 56, which the tiny vision-language model's
processor turns into (56/14)^2 / 2^2 = 4 image tokens, ``models/vlm.py``) is divided into a ``grid`` x
``grid`` board of cells (default 6 x 6, 9 px each); 1 to ``max_count`` (default 4) distinct cells hold a
filled square (2/3 of the cell, centred, so neighbours never touch) in one of four colours. The prompt asks
"how many squares?" and the answer is the count as a digit, scored by ``exact_match`` (``rewards/``).

A problem is its cells and colours; ``num_problems`` distinct ones are drawn from the task seed, with the
count uniform over 1..max_count as far as there are distinct problems of that count (one square has only
grid^2 x 4 = 144 placements, so it ends up a smaller share), and split once by a stable hash into training
and ``num_eval`` held-out problems, as the arithmetic tasks are (``tasks/arithmetic.py``): two different
problems are two different pictures, so no held-out picture is ever trained on.

The picture rides in ``Prompt.meta["images"]``, a list holding one PNG data URL (``utils/images.py``): the
form OpenAI ``image_url`` parts carry, JSON-safe for the endpoint and the inspector, small to ship to reward
workers (~200 bytes), and decoded losslessly by ``load_image``. ``Prompt.text`` is the text that follows the
image in the user turn (``models/vlm.py``'s ``user_message`` puts the image first).

``task.params.render=text`` renders the same problems as text instead, "squares at (1,2),(4,0): how many?"
(cells as column,row), with no image: the baseline of the "cost of vision" benchmark (issue 54), same answers.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from tidal.tasks import TASKS
from tidal.tasks.arithmetic import _SplitTask
from tidal.types import Prompt
from tidal.utils.images import to_data_url
from tidal.utils.seeding import stable_hash

COLORS = ((220, 40, 40), (40, 160, 60), (40, 80, 220), (240, 150, 20))
"""Red, green, blue, orange: distinct in every channel, so the count never depends on telling two apart."""
QUESTION = "how many squares?"
RENDERS = ("image", "text")


def render_squares(cells: tuple[tuple[int, int], ...], colors: tuple[int, ...], size: int = 56,
                   grid: int = 6) -> Image.Image:
    """The picture of one problem: cell (column, row) holds a square of ``COLORS[colors[i]]``."""
    cell = size // grid
    side = max(1, cell * 2 // 3)
    margin = (size - grid * cell) // 2 + (cell - side) // 2
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for (col, row), color in zip(cells, colors):
        x, y = margin + col * cell, margin + row * cell
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=COLORS[color])
    return image


def squares_text(cells: tuple[tuple[int, int], ...]) -> str:
    """The text rendering: "squares at (1,2),(4,0): how many?"."""
    return "squares at " + ",".join(f"({col},{row})" for col, row in cells) + ": how many?"


@TASKS.register("count_squares")
class CountSquares(_SplitTask):
    name = "count_squares"

    def _params(self) -> tuple[int, int, int, int, str]:
        p = self.cfg.params
        size, grid, max_count = p.get("size", 56), p.get("grid", 6), p.get("max_count", 4)
        num_problems, render = p.get("num_problems", 3000), p.get("render", "image")
        if not (isinstance(size, int) and isinstance(grid, int) and 1 <= grid and size >= 3 * grid):
            raise ValueError(f"task count_squares: params.size={size!r}, params.grid={grid!r}: need integers with "
                             "size >= 3 * grid (cells of at least 3 px)")
        if not (isinstance(max_count, int) and 1 <= max_count <= min(9, grid * grid)):
            raise ValueError(f"task count_squares: params.max_count={max_count!r} must be in [1, min(9, grid^2)] "
                             "(the answer is one digit)")
        if render not in RENDERS:
            raise ValueError(f"task count_squares: params.render={render!r} must be one of {RENDERS}")
        if not isinstance(num_problems, int) or num_problems <= self.cfg.num_eval:
            raise ValueError(f"task count_squares: params.num_problems={num_problems!r} must exceed "
                             f"num_eval={self.cfg.num_eval}")
        return size, grid, max_count, num_problems, render

    def _space(self) -> list:
        _, grid, max_count, num_problems, _ = self._params()
        rng = random.Random(stable_hash(self.cfg.seed, self.name))
        cells = [(col, row) for row in range(grid) for col in range(grid)]
        problems: set[tuple] = set()
        for count in range(1, max_count + 1):
            want = num_problems // max_count
            drawn: set[tuple] = set()
            for _ in range(want * 4):  # few repeats unless the count has fewer than ~want distinct problems
                chosen = tuple(sorted(rng.sample(cells, count)))
                drawn.add((chosen, tuple(rng.randrange(len(COLORS)) for _ in chosen)))
                if len(drawn) >= want:
                    break
            problems |= drawn
        return sorted(problems)

    def _prompt(self, item, uid: str) -> Prompt:
        size, grid, _, _, render = self._params()
        cells, colors = item
        meta = {"count": len(cells), "cells": [list(c) for c in cells]}
        if render == "text":
            return Prompt(uid=uid, text=squares_text(cells), answer=str(len(cells)), meta=meta)
        meta["images"] = [to_data_url(render_squares(cells, colors, size, grid))]
        return Prompt(uid=uid, text=QUESTION, answer=str(len(cells)), meta=meta)
