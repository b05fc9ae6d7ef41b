"""``hashes.json``: xxh3-128 digests (12x faster than sha256 here); older sha256 digests still verify."""

import hashlib
import json

import pytest
import xxhash

from tidal.train.checkpoint import HASHES, CheckpointCorrupted, file_digest, verify_hashes, write_hashes


def test_digest_is_xxh3_128_of_the_bytes(tmp_path):
    path = tmp_path / "trainer_state.pt"
    path.write_bytes(b"abc" * 1_000_000)  # several read chunks
    assert file_digest(path) == "xxh3_128:" + xxhash.xxh3_128(b"abc" * 1_000_000).hexdigest()


def test_written_hashes_verify_and_a_flipped_byte_fails(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 100)
    write_hashes(tmp_path, ["model.safetensors", "absent.pt"])
    recorded = json.loads((tmp_path / HASHES).read_text())
    assert list(recorded) == ["model.safetensors"] and recorded["model.safetensors"].startswith("xxh3_128:")
    assert verify_hashes(tmp_path) == 1
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[1000] ^= 1
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupted, match="model.safetensors is corrupted"):
        verify_hashes(tmp_path)


def test_a_checkpoint_hashed_with_sha256_still_verifies(tmp_path):
    """Checkpoints written before the switch carry bare sha256 hex digests."""
    (tmp_path / "trainer_state.pt").write_bytes(b"state")
    (tmp_path / HASHES).write_text(json.dumps({"trainer_state.pt": hashlib.sha256(b"state").hexdigest()}))
    assert verify_hashes(tmp_path) == 1
    (tmp_path / "trainer_state.pt").write_bytes(b"stale")
    with pytest.raises(CheckpointCorrupted, match="trainer_state.pt is corrupted"):
        verify_hashes(tmp_path)
