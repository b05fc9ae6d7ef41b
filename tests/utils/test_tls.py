"""``utils/tls.py``: verifying httpx clients share one TLS context per trust store; nothing else changes."""

import ssl
import warnings

import certifi
import httpx
import pytest

from tidal.utils.tls import share_verified_contexts


def context_of(client) -> ssl.SSLContext:
    return client._transport._pool._ssl_context


@pytest.fixture(scope="module")
def shared():
    return share_verified_contexts()


def test_verifying_clients_share_one_context(shared):
    assert "httpx._transports.default" in shared
    a, b = httpx.AsyncClient(), httpx.Client()
    assert context_of(a) is context_of(b)
    assert context_of(a).verify_mode == ssl.CERT_REQUIRED and context_of(a).check_hostname


def test_a_ca_bundle_path_is_its_own_shared_context(shared):
    with warnings.catch_warnings():  # httpx deprecates verify=<str> (verifiers' chat program uses it); warned
        warnings.simplefilter("ignore", DeprecationWarning)  # only while no earlier client built the context
        a = httpx.AsyncClient(verify=certifi.where())
        b = httpx.AsyncClient(verify=certifi.where())
    assert context_of(a) is context_of(b) is not context_of(httpx.AsyncClient())
    assert context_of(a).verify_mode == ssl.CERT_REQUIRED


def test_other_settings_are_never_shared_or_weakened(shared):
    insecure = httpx.AsyncClient(verify=False)
    assert context_of(insecure) is not context_of(httpx.AsyncClient(verify=False))
    assert context_of(insecure).verify_mode == ssl.CERT_NONE
    assert context_of(httpx.AsyncClient()).verify_mode == ssl.CERT_REQUIRED  # the shared one is untouched
    own = ssl.create_default_context()
    assert context_of(httpx.AsyncClient(verify=own)) is own


def test_install_is_idempotent(shared):
    import httpx._transports.default as transport

    before = transport.create_ssl_context
    assert share_verified_contexts() == shared and transport.create_ssl_context is before
    assert not getattr(before.__wrapped__, "tidal_shared", False)  # wrapped once, not twice


def test_httpx2_too_when_installed(shared):
    httpx2 = pytest.importorskip("httpx2")
    assert "httpx2._transports.default" in shared
    assert context_of(httpx2.AsyncClient()) is context_of(httpx2.AsyncClient())
