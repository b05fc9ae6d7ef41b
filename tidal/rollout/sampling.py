"""Sampling from logits with noise keyed by (sample, position), not by batch slot.

Gumbel-max: ``argmax(logits / T + G)`` with i.i.d. Gumbel noise G is an exact sample from
``softmax(logits / T)``. We derive the uniform noise from a counter-based integer hash of
(sample key, generated-token position, vocab id), so a sample's tokens do not depend on which
other sequences share its batch, on batch size, or on whether the generation was interrupted and
resumed. That is what makes async(eta=0) reproduce sync exactly and interruption tests exact.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (values kept in [0, 2^32) inside int64, so products never overflow)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(keys_n: torch.Tensor, positions_n: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, V] uniforms in (0, 1), a pure function of (key, position, vocab id)."""
    row = _hash32(_hash32(keys_n & _M32) ^ ((positions_n * 0x27D4EB2D) & _M32) ^ (keys_n >> 32))
    vocab = (torch.arange(vocab_size, dtype=torch.int64, device=keys_n.device) * 0x165667B1) & _M32
    bits = _hash32(row[:, None] ^ vocab[None, :])
    return (bits.to(torch.float64) + 0.5) / 2**32


def sample_tokens(
    logits_nv: torch.Tensor,
    keys_n: torch.Tensor,
    positions_n: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (token ids [n], behaviour log-probs [n]).

    The log-prob is that of the temperature-scaled distribution ``log_softmax(logits / T)`` (the
    trainer scores tokens with the same temperature). With ``top_p < 1`` sampling is restricted to
    the nucleus, and the log-prob is of the renormalized nucleus distribution, which is what was
    actually sampled from. ``temperature == 0`` is greedy decoding.
    """
    logits_nv = logits_nv.float()
    if temperature == 0:
        logp_nv = torch.log_softmax(logits_nv, dim=-1)
        tokens_n = logits_nv.argmax(dim=-1)
        return tokens_n, logp_nv.gather(1, tokens_n[:, None]).squeeze(1)
    logp_nv = torch.log_softmax(logits_nv / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp_nv.sort(dim=-1, descending=True)
        cum = sorted_logp.exp().cumsum(dim=-1)
        drop_sorted = (cum - sorted_logp.exp()) >= top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logp_nv = torch.log_softmax(logp_nv.masked_fill(drop, float("-inf")), dim=-1)
    tokens_n = _gumbel_argmax_for(logp_nv.device)(logp_nv, keys_n, positions_n)
    return tokens_n, logp_nv.gather(1, tokens_n[:, None]).squeeze(1)


def gumbel_argmax(logp_nv: torch.Tensor, keys_n: torch.Tensor, positions_n: torch.Tensor) -> torch.Tensor:
    """argmax(logp + Gumbel noise keyed by (key, position, vocab id)): one sampled token id per row."""
    u = uniform_noise(keys_n, positions_n, logp_nv.shape[-1])
    gumbel = (-torch.log(-torch.log(u))).to(logp_nv.dtype)
    return (logp_nv + gumbel).argmax(dim=-1)


_compiled_gumbel_argmax = None


def _gumbel_argmax_for(device: torch.device):
    """On CUDA, ``gumbel_argmax`` compiled into one fused kernel: eagerly it is ~20 passes over [rows x vocab]
    int64/float64 tensors (about 16 GB per decode step at 256 rows and a 152k vocabulary, several times the
    step itself). The fused kernel evaluates the same float64 expression, so the tokens are the same
    (tests/gpu). Elsewhere, or if compiling fails (said once), the eager function."""
    global _compiled_gumbel_argmax
    if device.type != "cuda":
        return gumbel_argmax
    if _compiled_gumbel_argmax is None:
        compiled = torch.compile(gumbel_argmax, dynamic=True)

        def safe(*args):
            global _compiled_gumbel_argmax
            try:
                return compiled(*args)
            except Exception as e:  # noqa: BLE001 (an inductor/triton failure must not stop generation)
                log.warning("compiling the sampler failed (%s: %s); sampling eagerly", type(e).__name__, e)
                _compiled_gumbel_argmax = gumbel_argmax
                return gumbel_argmax(*args)

        _compiled_gumbel_argmax = safe
    return _compiled_gumbel_argmax
