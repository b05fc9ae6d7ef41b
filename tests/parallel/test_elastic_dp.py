"""Elastic data parallel on the RL Trainer with real torchft processes: two replicas train, one dies in the
middle of a step, the survivor redoes the step alone, a fresh process for the dead replica heals from
the survivor and rejoins, and every update equals the 1-process trainer's (the per-token normalisation
does not depend on how many replicas are alive). Then a bit flipped in one replica's weights is found:
by that replica's at-rest check (naming its rank) and by comparing the replicas' fingerprints."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="torchft not installed (pip install -e '.[dev]')")

from tidal.algo.config import AlgoConfig  # noqa: E402
from tidal.models import tiny  # noqa: E402
from tidal.optim import OptimConfig  # noqa: E402
from tidal.train.config import TrainerConfig  # noqa: E402
from tidal.train.trainer import Trainer  # noqa: E402
from tidal.types import TrainBatch  # noqa: E402

STEPS = 5  # the 5th step carries an injected flip
PARAM = "model.layers.1.mlp.up_proj.weight"
MODEL = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)


def _trainer(model, dp=None):
    kw = {"dp": dp} if dp is not None else {}
    return Trainer(model, AlgoConfig(), OptimConfig(lr=1e-2), TrainerConfig(), **kw)


def _batches(tok) -> list[TrainBatch]:
    """Groups of 4 rows with different prompt and response lengths (the split is by whole groups and
    tokens) and rewards that vary inside each group (every group has an advantage)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        b, t = 20, 16
        lengths = torch.randint(8, t + 1, (b,), generator=g)
        prompt = torch.randint(2, 6, (b,), generator=g)
        attn = (torch.arange(t)[None] < lengths[:, None]).long()
        mask = ((torch.arange(t)[None] >= prompt[:, None]) & attn.bool()).float()
        out.append(TrainBatch(torch.randint(3, len(tok), (b, t), generator=g) * attn, attn, mask,
                              -torch.rand(b, t, generator=g) * mask, mask.long() - 1,
                              torch.arange(b) // 4, torch.rand(b, generator=g).round()))
    return out


def _worker(role: str, tmp: Path) -> None:
    """Replica ``r0`` (lives throughout), ``r1a`` (dies in step 2's forward) or ``r1b`` (replaces it)."""
    from tidal.integrity.faults import flip_bit
    from tidal.parallel.elastic_dp import ElasticDP, ElasticTrainer, replica_manager

    torch.set_num_threads(1)
    tok = tiny.build_tokenizer()
    model = tiny.build_model(MODEL, tok)
    model.load_state_dict(torch.load(tmp / "init.pt"))
    batches = _batches(tok)
    dp = ElasticDP(None)  # the manager needs the trainer (to heal it) and the trainer needs the dp
    trainer = _trainer(model, dp)
    with replica_manager(trainer, os.environ["TORCHFT_LIGHTHOUSE"], "replica1" if role != "r0" else "replica0",
                         timeout_s=5.0) as manager:
        dp.manager = manager
        elastic = ElasticTrainer(trainer, manager)
        (tmp / f"ready_{role}").touch()
        if role != "r1b":
            while not all((tmp / f"ready_{r}").exists() for r in ("r0", "r1a")):
                time.sleep(0.05)
        if role == "r1a":
            def die(module, args, output):
                if manager.current_step() == 1:  # step 2, in its first forward: after step 1 together
                    os._exit(0)
            model.get_decoder().register_forward_hook(die)  # the trainer calls the decoder, then the head
        log = []
        while manager.current_step() < STEPS:
            if role == "r0" and manager.current_step() == 2:
                while not (tmp / "ready_r1b").exists():  # let the replacement join before step 3
                    time.sleep(0.05)
            if role == "r1b" and manager.current_step() == STEPS - 1:  # memory corruption on this replica
                flip_bit(dict(model.named_parameters())[PARAM].data, 5, 20)
            m = elastic.step_at(lambda k: batches[k])
            log.append({k: m[k] for k in ("elastic/step", "elastic/participants", "elastic/failed_attempts")})
            if m["elastic/step"] == STEPS - 2:
                torch.save(model.state_dict(), tmp / f"final_{role}.pt")
            if role == "r0":
                (tmp / f"r0_step_{int(m['elastic/step'])}").touch()
        (tmp / f"log_{role}.json").write_text(json.dumps({"log": log, "incidents": elastic.incidents}))


@pytest.mark.slow  # three Python processes start (~30 s each on a loaded 2-core machine)
def test_a_replica_dies_mid_step_the_other_continues_and_a_replacement_heals_and_rejoins(tmp_path):
    from tidal.parallel.diloco import start_lighthouse

    torch.manual_seed(0)
    tok = tiny.build_tokenizer()
    model = tiny.build_model(MODEL, tok)
    torch.save(model.state_dict(), tmp_path / "init.pt")
    reference = _trainer(tiny.build_model(MODEL, tok))
    reference.model.load_state_dict(model.state_dict())
    for batch in _batches(tok)[: STEPS - 1]:
        reference.step(batch)

    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1000)
    root = str(Path(__file__).resolve().parents[2])  # this checkout's tidal, whatever is installed
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse.address(),
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}

    def start(role):
        return subprocess.Popen([sys.executable, __file__, role, str(tmp_path)], env=env,
                                stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{role}.log").open("w"))
    try:
        r0, r1a = start("r0"), start("r1a")
        assert r1a.wait(timeout=300) == 0
        r1b = start("r1b")
        for name, p in (("r0", r0), ("r1b", r1b)):
            assert p.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        lighthouse.shutdown()

    out0 = json.loads((tmp_path / "log_r0.json").read_text())
    out1 = json.loads((tmp_path / "log_r1b.json").read_text())
    log0, log1 = out0["log"], out1["log"]
    assert [e["elastic/step"] for e in log0] == [0, 1, 2, 3, 4]
    assert [e["elastic/participants"] for e in log0] == [2, 1, 2, 2, 2]
    assert log0[-1]["elastic/failed_attempts"] >= 1  # step 2's first attempt had the dying replica in it
    assert [e["elastic/step"] for e in log1] == [2, 3, 4]  # healed at the quorum's step, not from 0
    # the flip in replica 1's weights before step 5 (quorum step 4): named by its own at-rest check, and
    # seen by both replicas when they compare what the step left (two replicas: a tie, both named)
    layer = "model.layers.1"
    assert {"step": 4, "phase": "weights", "entry": layer, "ranks": [1], "ambiguous": False,
            "how": "at-rest check of this replica"} in out1["incidents"]
    for out in (out0, out1):
        assert {"step": 4, "phase": "optimizer", "entry": layer, "ranks": [0, 1], "ambiguous": True,
                "how": "replicas compared"} in out["incidents"], out["incidents"]
        assert all(i["step"] == 4 for i in out["incidents"]), "no false alarm before the flip"
    final0 = torch.load(tmp_path / "final_r0.pt")
    final1 = torch.load(tmp_path / "final_r1b.pt")
    assert all(torch.equal(final0[k], final1[k]) for k in final0), "replicas must be bit-identical (step 4)"
    ref, init = reference.model.state_dict(), model.state_dict()
    moved = max(float((ref[k] - init[k]).abs().max()) for k in ref)
    diff = max(float((final0[k] - ref[k]).abs().max()) for k in ref)
    assert moved > 1e-2 and diff < 1e-3 * moved, f"elastic run off the 1-process run by {diff} (moved {moved})"


def _listening() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on (Linux /proc)."""
    import ipaddress

    mine = {os.readlink(f"/proc/self/fd/{fd}")[8:-1] for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")}
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:  # state LISTEN, this process's socket inode
                ip, port = f[1].split(":")
                raw = bytes.fromhex(ip)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word little-endian
                out.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return out


def _one_replica_listens(host: str) -> tuple[set, list[str]]:
    """The lighthouse and one replica on ``host``, through a quorum and an all-reduce: (the listeners they
    opened, the addresses they hand to peers)."""
    from tidal.parallel.diloco import start_lighthouse
    from tidal.parallel.elastic_dp import ElasticDP, replica_manager

    before = set(_listening())
    lighthouse = start_lighthouse(min_replicas=1, host=host)
    try:
        dp = ElasticDP(None)
        trainer = _trainer(tiny.build_model(MODEL, tiny.build_tokenizer()), dp)
        with replica_manager(trainer, lighthouse.address(), "replica0", timeout_s=5.0, host=host) as manager:
            dp.manager = manager
            manager.start_quorum()
            manager.allreduce(torch.ones(2)).wait()
            opened = set(_listening()) - before
            return opened, [lighthouse.address(), manager._manager.address(),
                            manager._checkpoint_transport.metadata()]
    finally:
        lighthouse.shutdown()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="lists sockets through /proc")
def test_by_default_every_torchft_listener_is_on_loopback(caplog):
    """trainer.data_parallel=elastic used to open the lighthouse (``[::]:0``), each replica's manager server,
    TCP store and checkpoint server (which serves the policy's weights and optimizer state) on every
    interface. The defaults bind them to loopback, and every address handed to a peer names it."""
    import ipaddress

    from tidal.parallel.elastic_dp import ElasticConfig

    host = ElasticConfig().host
    opened, addresses = _one_replica_listens(host)
    assert len(opened) >= 4, opened  # lighthouse, manager server, store, checkpoint server (and gloo)
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in opened), opened
    assert all(a.startswith(f"http://{host}:") for a in addresses), addresses
    assert "beyond loopback" not in caplog.text


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="lists sockets through /proc")
def test_a_wider_host_is_used_and_warned_about(caplog):
    import socket

    opened, addresses = _one_replica_listens("0.0.0.0")  # trainer.elastic.host=0.0.0.0: every interface
    assert len(opened) >= 4 and {a for a, _ in opened} >= {"0.0.0.0"}, opened
    assert all(a.startswith(f"http://{socket.gethostname()}:") for a in addresses), addresses
    assert "torchft listens on 0.0.0.0 (trainer.elastic.host), beyond loopback" in caplog.text


def test_disagreeing_ranks_by_hand():
    from tidal.parallel.elastic_dp import _signed, disagreeing_ranks

    bits = torch.tensor([[5, 7, 1], [5, 8, 1], [5, 7, 2]])
    assert disagreeing_ranks(bits, ["a", "b", "c"]) == [
        {"entry": "b", "ambiguous": False, "ranks": [1]}, {"entry": "c", "ambiguous": False, "ranks": [2]}]
    assert disagreeing_ranks(torch.tensor([[1], [2]]), ["a"]) == [{"entry": "a", "ambiguous": True, "ranks": [0, 1]}]
    assert disagreeing_ranks(torch.tensor([[3], [3]]), ["a"]) == []
    assert _signed((1 << 64) - 1) == -1 and _signed(5) == 5  # mod 2^64 fingerprints fit an int64 exactly


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
