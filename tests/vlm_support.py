"""What the vision-language tests share: the tiny Qwen2-VL with its processor on its tokenizer, and two pictures."""

from tidal.api import EnvStep
from tidal.models import vlm
from tidal.tasks.visual import render_squares
from tidal.utils.images import to_data_url

BOARD = to_data_url(render_squares(((0, 0), (4, 1), (2, 4)), (0, 1, 2)))
SEEN = to_data_url(render_squares(((1, 1), (3, 3)), (3, 1)))


def tiny_vlm_policy(family: str = "qwen2_vl"):
    """(model, tokenizer with the processor attached, processor): what ``model.vision=true`` gives a run."""
    processor = vlm.build_processor(vlm.VLMConfig())
    model = vlm.build_vlm(vlm.VLMConfig(family=family), processor)
    return model, vlm.attach_processor(processor.tokenizer, processor), processor


class ShowPictures:
    """An environment that answers each of the first turns with the next of ``pictures`` ("see:" and an
    ``image_url`` part) whatever the text, and ends the episode (reward 1) at the turn after them."""

    stop: list[str] = []
    pictures: tuple[str, ...] = (SEEN,)

    def reset(self, prompt):
        self.turns = 0
        return None

    def step(self, turn_text):
        self.turns += 1
        if self.turns <= len(self.pictures):
            return EnvStep([{"type": "text", "text": "see:"},
                            {"type": "image_url", "image_url": {"url": self.pictures[self.turns - 1]}}],
                           info={"tool_call": True})
        return EnvStep(None, reward=1.0, done=True)
