"""One torchft replica group of one process: the Manager that DiLoCo workers and elastic replicas share.

Each replica is its own replica group (``rank=0, world_size=1``) with a private TCPStore, and the replicas
meet through the lighthouse (``TORCHFT_LIGHTHOUSE``). ``use_async_quorum=False``: a replica that
(re)starts behind the quorum heals inside ``start_quorum``, loading a live peer's ``state_dict()`` through
``load_state_dict`` before it takes part. ``init_sync`` makes a fresh group start from one replica's state.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch


def quiet_torchft() -> None:
    """Keep torchft's own logging to warnings and errors unless the user set ``RUST_LOG``. Its Rust side logs
    every quorum and lighthouse state at INFO to stderr: ~1,000 lines in a 60-step run with 2 replicas,
    which bury the run's own messages. Call before torchft is imported (its logger reads the variable
    once); spawned replica processes inherit it."""
    os.environ.setdefault("RUST_LOG", "warn")


@contextmanager
def replica_group(state_dict: Callable[[], dict], load_state_dict: Callable[[dict], object], lighthouse_addr: str,
                  replica_id: str, timeout_s: float, quorum_timeout_s: float, min_replicas: int = 1,
                  init_sync: bool = True) -> Iterator[object]:
    """A torchft ``Manager`` for this process's replica group, shut down on exit. ``timeout_s`` bounds an
    all-reduce with a dead peer and a recovery; ``quorum_timeout_s`` how long a step waits for a quorum."""
    quiet_torchft()
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # lives as long
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=min_replicas, use_async_quorum=False,
        load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=replica_id, store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse_addr, hostname=socket.gethostname(), timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s), connect_timeout=timeout, init_sync=init_sync)
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)
