"""A task's supervised examples as tensors: "<bos>prompt answer<eos>" rows (or a conversation rendered by the
chat template) with labels on the answer only. The warm start (``stages/warm_start.py``), the pre-training loop's
evaluation (``stages/pretrain.py``) and the elastic supervised loop (``parallel/elastic.py``) train on them."""

from __future__ import annotations

import torch

from tidal.api import Task
from tidal.config import ConfigError
from tidal.models import prompts


def _encode(tokenizer, prompt_text: str, example) -> tuple[list[int], int]:
    """(ids, where the loss starts). ``example`` is the answer text ("<bos>prompt answer<eos>"), or a
    whole conversation as OpenAI messages (a tool-using agent's trace), rendered by the tokenizer's
    chat template; the loss then covers everything after the first assistant turn's generation prompt
    (the model's turns and, as in the plain tool traces, the tools' results between them)."""
    if isinstance(example, list):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the task's warm-start example is a conversation, but the tokenizer has no chat "
                                 "template (set model.tokenizer=chat)")
        # the prompt: everything before the first assistant turn (a system message, then the user's)
        first = next((i for i, m in enumerate(example) if m.get("role") == "assistant"), 1)
        head = tokenizer.apply_chat_template(example[:first], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(example, tokenize=False)
        assert full.startswith(head), "the chat template must render the first turn as a prefix"
        prompt_ids = tokenizer(head, add_special_tokens=False).input_ids
        rest = tokenizer(full[len(head):].rstrip("\n"), add_special_tokens=False).input_ids
        return [*prompt_ids, *rest], len(prompt_ids)
    prompt_ids = prompts.prompt_ids(tokenizer, prompt_text)  # as RL reads the prompt (chat template or BOS + text)
    answer_ids = [*tokenizer(example, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    return prompt_ids + answer_ids, len(prompt_ids)


def sft_batch(tokenizer, task: Task, prompts: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, labels) of "<bos>prompt answer<eos>" rows, right-padded, with labels
    (-100 elsewhere) on the answer tokens only."""
    examples = [_encode(tokenizer, p.text, task.sft_example(p)) for p in prompts]
    width = max(len(ids) for ids, _ in examples)
    ids_bt = torch.full((len(examples), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids_bt, -100)
    attn = torch.zeros_like(ids_bt)
    for r, (ids, start) in enumerate(examples):
        ids_bt[r, : len(ids)] = torch.tensor(ids)
        attn[r, : len(ids)] = 1
        labels[r, start : len(ids)] = ids_bt[r, start : len(ids)]
    return ids_bt, attn, labels


def vision_sft_batch(tokenizer, task: Task, chosen: list):
    """A vision-language model's warm-start rows: (``vlm.VisionBatch`` of prompt-with-images + answer + EOS,
    right-padded, each prompt's images once; the answer columns [B, T] as a bool mask). The prompt is rendered as
    RL reads it (``vlm.prompt_ids`` through the processor attached to ``tokenizer``)."""
    from tidal.models import vlm

    processor = vlm.processor_of(tokenizer)
    system = prompts.format_of(tokenizer).system_prompt
    rows, starts, images, row_images = [], [], [], []
    for p in chosen:
        example = task.sft_example(p)
        if not isinstance(example, str):
            raise ConfigError(f"prompt {p.uid}: a vision-language warm start trains on answer texts, not conversations")
        ids = vlm.prompt_ids(processor, p.text, p.images, system, f"prompt {p.uid}")
        starts.append(len(ids))
        rows.append([*ids, *tokenizer(example, add_special_tokens=False).input_ids, tokenizer.eos_token_id])
        row_images.append(list(range(len(images), len(images) + len(p.images))))
        images.extend(p.images)
    width = max(map(len, rows))
    ids_bt = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids_bt)
    answer_bt = torch.zeros_like(ids_bt, dtype=torch.bool)
    for r, (ids, start) in enumerate(zip(rows, starts)):
        ids_bt[r, : len(ids)] = torch.tensor(ids)
        attn[r, : len(ids)] = 1
        answer_bt[r, start : len(ids)] = True
    pixels, grids = vlm.image_batch(processor, images) if images else (None, None)
    return vlm.VisionBatch(ids_bt, attn, pixels, grids, row_images), answer_bt
