"""Deterministic seeding and per-sample random streams.

Sampling noise for a response is keyed by (run seed, prompt uid, sample index), never by batch
position, so the same response comes out whatever batch it lands in, whether or not it was
interrupted, and in sync or async mode.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def stable_hash(*parts: object) -> int:
    """A process-independent 63-bit hash (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``; CUDA generators only where this machine has as many GPUs (a GPU run's
    checkpoint resumes on a CPU machine too: tidal's sampling noise is hashed, not drawn, see above)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
