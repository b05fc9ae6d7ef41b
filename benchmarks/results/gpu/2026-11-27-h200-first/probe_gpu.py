"""Throwaway first look at 0.5B-shape speed on the GPU (not committed)."""
import json, os, random, sys, time
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from tidal.algo.config import AlgoConfig
from tidal.optim import OptimConfig
from tidal.train.trainer import Trainer, TrainerConfig
from tidal.types import TrainBatch
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.api import GenRequest
from tidal.types import Prompt
from tidal.models import tiny

out = {}
SMALL = os.environ.get("PROBE_SMALL") == "1"
DEV = "cpu" if SMALL else "cuda"
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
cfg = Qwen2Config(vocab_size=4096 if SMALL else 151936, hidden_size=64 if SMALL else 896, num_hidden_layers=2 if SMALL else 24,
                  num_attention_heads=2 if SMALL else 14, num_key_value_heads=2, intermediate_size=128 if SMALL else 4864, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
                  attn_implementation="sdpa")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
n_params = sum(p.numel() for p in model.parameters())
def batch(num_groups=2 if SMALL else 4, g=4 if SMALL else 16, prompt=16 if SMALL else 256, max_resp=64 if SMALL else 1536):
    rng = random.Random(0); rows = []
    for k in range(num_groups):
        p = [rng.randrange(100, cfg.vocab_size) for _ in range(prompt)]
        for j in range(g):
            n = min(max_resp, int(32 / (1 - rng.random()) ** 0.7))
            rows.append((p, [rng.randrange(100, cfg.vocab_size) for _ in range(n)], k, float(j % 2)))
    T = max(len(p) + len(r) for p, r, _, _ in rows); B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long); att = torch.zeros(B, T, dtype=torch.long); lm = torch.zeros(B, T)
    for i, (p, r, k, _) in enumerate(rows):
        s = p + r; ids[i, :len(s)] = torch.tensor(s); att[i, :len(s)] = 1; lm[i, len(p):len(s)] = 1
    return TrainBatch(ids, att, lm, -lm * 10, torch.where(lm > 0, 0, -1).long(), torch.tensor([r[2] for r in rows]),
                      torch.tensor([r[3] for r in rows]))
b = batch(); tokens = int(b.attention_mask_bt.sum())
for name, tcfg in [("packed_dense", dict(packing=True, pack_tokens=2048, micro_batch_tokens=8192))]:
    try:
        tr = Trainer(model, AlgoConfig(), OptimConfig(lr=1e-6), TrainerConfig(precision="bf16", **tcfg), device=DEV)
        tr.step(b); sync(); t = time.perf_counter()
        for _ in range(3): m = tr.step(b)
        sync(); dt = (time.perf_counter() - t) / 3
        out[name] = dict(tokens=tokens, step_s=dt, tok_s=tokens / dt, mfu_6N=6 * n_params * tokens / dt / 989e12,
                         peak_gb=torch.cuda.max_memory_allocated() / 1e9)
    except Exception as e:
        out[name] = repr(e)[:500]
    print(name, out[name], flush=True)
tok = tiny.build_tokenizer()
NEW, BATCH = (16, 8) if SMALL else (256, 256)
model.config.eos_token_id = tok.eos_token_id
try:
    eng = LocalEngine(tr.model, tok, SamplingConfig(dtype="bf16", max_new_tokens=NEW, max_batch_size=BATCH))
    eng.eos_id = -1
    reqs = [GenRequest(Prompt(f"p{i}", "", ""), tuple(random.randrange(3, 50) for _ in range(128)), i, max_new_tokens=NEW)
            for i in range(BATCH)]
    eng.generate(reqs[:8]); sync(); t = time.perf_counter()
    trajs = eng.generate(reqs); sync(); dt = time.perf_counter() - t
    n = sum(x.num_tokens for x in trajs)
    out["engine"] = dict(new_tokens=n, s=dt, tok_s=n / dt)
    hf = eng.model
    ids = torch.tensor([r.prompt_ids for r in reqs], device=DEV)
    sync(); t = time.perf_counter()
    g = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True,
                    pad_token_id=0)
    sync(); dt = time.perf_counter() - t
    out["hf_generate"] = dict(new_tokens=NEW * BATCH, s=dt, tok_s=NEW * BATCH / dt)
except Exception as e:
    import traceback; traceback.print_exc(); out["engine_err"] = repr(e)[:500]
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
