"""One torchft replica group of one process: the Manager that DiLoCo workers and elastic replicas share.

Each replica is its own replica group (``rank=0, world_size=1``) with a private TCPStore, and the replicas
meet through the lighthouse (``TORCHFT_LIGHTHOUSE``). ``use_async_quorum=False``: a replica that
(re)starts behind the quorum heals inside ``start_quorum``, loading a live peer's ``state_dict()`` through
``load_state_dict`` before it takes part. ``init_sync`` makes a fresh group start from one replica's state.

Where it listens: every server of a group, and the lighthouse, binds to one ``host``, loopback by default
(``LOOPBACK``). The replicas are processes of one machine (peers always reached a group's store at
``localhost``), and the servers take no credentials, while one of them, the checkpoint server, hands the
policy's weights and optimizer state to whoever asks. torchft 0.2 binds its manager and checkpoint servers
(and the lighthouse, at ``[::]``) to every interface, and gloo to the address the machine's hostname
resolves to, with no option; ``_bound_to`` puts each on ``host`` (``trainer.elastic.host`` widens it, with a
warning: docs/faults.md).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from http.server import ThreadingHTTPServer
from unittest import mock

import torch

from tidal.train.data_parallel import LOOPBACK

log = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::")
"""Hosts that bind every interface; peers are then told this machine's hostname."""


def quiet_torchft() -> None:
    """Keep torchft's own logging to warnings and errors unless the user set ``RUST_LOG``. Its Rust side logs
    every quorum and lighthouse state at INFO to stderr: ~1,000 lines in a 60-step run with 2 replicas,
    which bury the run's own messages. Call before torchft is imported (its logger reads the variable
    once); spawned replica processes inherit it."""
    os.environ.setdefault("RUST_LOG", "warn")


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname
        return False


def advertised(host: str) -> str:
    """The name peers reach a server bound to ``host`` by: ``host``, or this machine's hostname for a wildcard."""
    return socket.gethostname() if host in WILDCARDS else host


def netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Lighthouse:
    """A torchft lighthouse bound to ``host``; ``address()`` is the URL its clients use (torchft's own names
    the machine's hostname, which need not resolve to ``host``)."""

    def __init__(self, host: str, **kwargs):
        from torchft.coordination import LighthouseServer

        if not is_loopback(host):  # only trainer.elastic.host sets another host
            log.warning("torchft listens on %s (trainer.elastic.host), beyond loopback and with no authentication: "
                        "anything that reaches its ports can join the quorum or read the policy's weights and "
                        "optimizer state", host)
        self.host = host
        self.server = LighthouseServer(bind=netloc(host, 0), **kwargs)

    def address(self) -> str:
        return f"http://{netloc(advertised(self.host), int(self.server.address().rsplit(':', 1)[1]))}"

    def shutdown(self) -> None:
        self.server.shutdown()


def _gloo_backend(host: str, store, rank: int, size: int, timeout: timedelta):
    """torch's gloo backend with its device on ``host`` (torchft builds the default device)."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=advertised(host))]
    options._timeout = timeout
    return ProcessGroupGloo(store, rank, size, options)


def _http_server_on(host: str) -> type:
    class Server(ThreadingHTTPServer):  # torchft's _IPv6HTTPServer, bound to host instead of every interface
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        request_queue_size = 1024

        def __init__(self, address, handler):
            super().__init__((host, address[1]), handler)

    return Server


@contextmanager
def _bound_to(host: str, timeout: timedelta) -> Iterator[tuple[object, object, torch.distributed.TCPStore]]:
    """(process group, checkpoint transport, store) whose servers bind to ``host``; inside the block, a
    ``Manager`` built binds its manager server there too. The patches reach into torchft 0.2's modules
    (``tests/parallel/test_elastic_dp.py`` checks every listener)."""
    import torchft.manager
    import torchft.process_group
    from torchft.checkpointing import http_transport

    class Gloo(torchft.process_group.ProcessGroupGloo):
        def _create_pg(self, store, rank, world_size):  # torchft's, with the device on host
            with mock.patch.object(torchft.process_group, "BaseProcessGroupGloo", partial(_gloo_backend, host)):
                return super()._create_pg(store, rank, world_size)

    class CheckpointServer(http_transport.HTTPTransport):
        def address(self) -> str:
            return f"http://{netloc(advertised(host), self._server.socket.getsockname()[1])}/checkpoint/"

    real_manager_server = torchft.manager.ManagerServer

    def manager_server(*, bind: str, **kwargs):
        return real_manager_server(bind=netloc(host, int(bind.rpartition(":")[2])), **kwargs)

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    port = listener.getsockname()[1]
    store = torch.distributed.TCPStore(advertised(host), port, is_master=True, wait_for_workers=False,
                                       master_listen_fd=listener.detach())  # the store owns (and closes) it
    with mock.patch.object(http_transport, "_IPv6HTTPServer", _http_server_on(host)):
        transport = CheckpointServer(timeout=timeout, num_chunks=0)
    with mock.patch.object(torchft.manager, "ManagerServer", manager_server):
        yield Gloo(timeout=timeout), transport, store


@contextmanager
def replica_group(state_dict: Callable[[], dict], load_state_dict: Callable[[dict], object], lighthouse_addr: str,
                  replica_id: str, timeout_s: float, quorum_timeout_s: float, min_replicas: int = 1,
                  init_sync: bool = True, host: str = LOOPBACK) -> Iterator[object]:
    """A torchft ``Manager`` for this process's replica group, shut down on exit. ``timeout_s`` bounds an
    all-reduce with a dead peer and a recovery; ``quorum_timeout_s`` how long a step waits for a quorum;
    ``host`` is where the group's servers listen (see the module docstring)."""
    quiet_torchft()
    from torchft.manager import Manager

    timeout = timedelta(seconds=timeout_s)
    with _bound_to(host, timeout) as (pg, transport, store):  # the store lives as long as the manager
        manager = Manager(
            pg=pg, min_replica_size=min_replicas, use_async_quorum=False, load_state_dict=load_state_dict,
            state_dict=state_dict, replica_id=replica_id, store_addr=advertised(host), store_port=store.port, rank=0,
            world_size=1, lighthouse_addr=lighthouse_addr, hostname=advertised(host), timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s), connect_timeout=timeout, init_sync=init_sync,
            checkpoint_transport=transport)
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)
