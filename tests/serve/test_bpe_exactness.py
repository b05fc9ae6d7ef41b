"""Exact continuation with a BPE tokenizer (trained in-process on a few strings): the server continues an
episode from the ids the engine sampled, where re-tokenizing the conversation's text merges differently.

With the character tokenizer ``encode(decode(ids)) == ids`` always holds, so drift cannot show; with BPE a
sampled ``"1" "2"`` decodes to ``"12"``, which re-encodes as one merged token. The test first checks
that this episode is such a case (re-tokenizing the rendered conversation gives other ids), then that
the recorded episode holds exactly the sampled ids and the trainer's log-probs equal the engine's."""

from __future__ import annotations

import openai
import torch

from tidal.models import tiny
from tidal.models.logprobs import token_logprobs
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.serve.server import HarnessServer

from ..rollout.bpe_fixture import build_bpe_tokenizer

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_continuation_uses_sampled_ids_where_retokenizing_would_merge_differently():
    tok = build_bpe_tokenizer()
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                              intermediate_size=64), tok).eval()
    server = HarnessServer(LocalEngine(model, tok, SamplingConfig(max_new_tokens=12), seed=0), tok, 128).start()
    try:
        client = openai.OpenAI(base_url=server.base_url("bpe"), api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "the sum of 12+34"}]
        sampled = []
        for observation in ("=46 then add 7", "=53"):
            resp = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            sampled.append(resp.model_extra["tidal"]["token_ids"])
            assert not resp.model_extra["tidal"]["new_segment"] or len(sampled) == 1
            reply = resp.choices[0].message.model_dump(exclude_none=True)
            messages += [reply, {"role": "tool", "content": observation}]
        resp = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        sampled.append(resp.model_extra["tidal"]["token_ids"])
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
        [traj] = server.finish("bpe", 1.0)
    finally:
        server.stop()
    recorded = traj.prompt_ids + traj.token_ids
    # re-rendering the same conversation as text and tokenizing it gives other ids: drift would happen here
    text = tok.apply_chat_template([{"role": m["role"], "content": m.get("content") or ""} for m in messages],
                                   tokenize=False)
    retokenized = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(recorded) == text.removesuffix("<eos>") or tok.decode(recorded) == text
    assert retokenized[: len(recorded)] != recorded, "this episode must be one where re-tokenizing merges differently"
    # the recorded episode holds exactly the sampled ids, in order, as the policy's tokens
    runs, cur = [], []
    for t, m in zip(traj.token_ids, traj.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = runs + [cur], []
    assert runs + [cur] == sampled and traj.episode["history_edits"] == 0
    ids = torch.tensor([recorded])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    diff = (logp[0, len(traj.prompt_ids):][mask] - torch.tensor(traj.logprobs)[mask]).abs().max().item()
    assert diff < 1e-4, diff
