"""``zoom``: a visual tool environment, where the tool's result is a picture (docs/vlm.md, issue 54).

The prompt shows a picture (``Prompt.images``, e.g. ``count_squares``' board). A model turn either calls the
tool, ``<zoom>Q</zoom>`` with Q a quadrant (1 top-left, 2 top-right, 3 bottom-left, 4 bottom-right), and gets
back that quarter of the prompt's first picture scaled up to the picture's size (nearest neighbour, so no colour
is invented), as an observation of OpenAI content parts ``[{"type": "text", "text": "zoom Q:"},
{"type": "image_url", "image_url": {"url": <PNG data URL>}}]``; or it answers, and the episode ends with reward
1 when the turn's stripped text is the prompt's answer. A call with another Q is malformed and answered with
text. The observation's picture reaches the policy only through a vision-language model and
``env.renderer=chat`` (``rollout/render.py`` widens it to its image tokens); a prompt without a picture is the
environment's failure (``reset`` raises: an infrastructure failure, kept out of its group).

Pure PIL, no torch (``envs`` is layer 2); the pictures are data URLs, so an episode's journal stays JSON.
"""

from __future__ import annotations

from PIL import Image

from tidal.api import EnvStep
from tidal.envs import ENVS
from tidal.types import Prompt
from tidal.utils.images import load_image, to_data_url

OPEN, CLOSE = "<zoom>", "</zoom>"


def zoom_quadrant(image: Image.Image, quadrant: int) -> Image.Image:
    """Quarter ``quadrant`` (1-4, row-major from the top left) of ``image``, scaled back to its size."""
    w, h = image.size
    left, top = (quadrant - 1) % 2 * w // 2, (quadrant - 1) // 2 * h // 2
    box = (left, top, left + w // 2 if quadrant % 2 else w, top + h // 2 if quadrant <= 2 else h)
    return image.crop(box).resize((w, h), Image.Resampling.NEAREST)


@ENVS.register("zoom")
class Zoom:
    """See the module docstring. ``prefix``: the observation's text before its picture."""

    stop: list[str] = [CLOSE]

    def __init__(self, prefix: str = "zoom "):
        self.prefix = prefix
        self.picture: Image.Image | None = None
        self.answer = ""

    def reset(self, prompt: Prompt) -> str | None:
        if not prompt.images:
            raise ValueError(f"zoom: prompt {prompt.uid} shows no picture to zoom into")
        self.picture = load_image(prompt.images[0], f"prompt {prompt.uid}, image 0")
        self.answer = prompt.answer.strip()
        return None

    def step(self, turn_text: str) -> EnvStep:
        start = turn_text.find(OPEN)
        if start < 0:  # an answer
            correct = turn_text.strip() == self.answer
            return EnvStep(None, reward=float(correct), done=True, info={"correct": correct})
        arg = turn_text[start + len(OPEN):].removesuffix(CLOSE).strip()
        if arg not in ("1", "2", "3", "4"):
            return EnvStep("zoom 1-4?", info={"malformed": True})
        url = to_data_url(zoom_quadrant(self.picture, int(arg)))
        return EnvStep([{"type": "text", "text": f"{self.prefix}{arg}:"},  # type: ignore[arg-type]
                        {"type": "image_url", "image_url": {"url": url}}], info={"tool_call": True})
