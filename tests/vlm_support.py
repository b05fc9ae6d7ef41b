"""What the vision-language tests share: the tiny Qwen2-VL with its processor on its tokenizer, and two pictures."""

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
