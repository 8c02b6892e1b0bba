"""--enable-ssl-refresh (voltllm/entrypoints/openai/tls_refresh.py): a live server context serves replaced certificate
files from the next handshake on; a pair that does not load (a key of another certificate) keeps the old one served
until a later change loads. Handshakes run in memory (ssl.MemoryBIO), no sockets."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
import subprocess

import pytest

from voltllm.entrypoints.openai.tls_refresh import file_stamps, refresh_tls_on_change


def _make_pair(d, name: str) -> tuple[str, str]:
    key, crt = str(d / f"{name}.key"), str(d / f"{name}.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", crt, "-days",
                    "1", "-subj", f"/CN={name}"], check=True, capture_output=True)
    return key, crt


def _served(server_ctx: ssl.SSLContext) -> bytes:
    """The DER certificate a client gets in a handshake with server_ctx."""
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname, client_ctx.verify_mode = False, ssl.CERT_NONE
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_side=False)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        done = 0
        for side, out, peer_in in ((client, c_out, s_in), (server, s_out, c_in)):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            peer_in.write(out.read())
        if done == 2:
            return client.getpeercert(binary_form=True)
    raise AssertionError("the in-memory handshake did not finish")


def _der(crt: str) -> bytes:
    with open(crt) as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


@pytest.fixture
def pairs(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    return {name: _make_pair(tmp_path, name) for name in ("first", "second", "third")}


def test_replaced_files_are_served_and_a_bad_pair_keeps_the_old(tmp_path, pairs, caplog):
    key, crt = str(tmp_path / "live.key"), str(tmp_path / "live.pem")
    shutil.copy(pairs["first"][0], key)
    shutil.copy(pairs["first"][1], crt)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    assert _served(ctx) == _der(pairs["first"][1])

    async def scenario():
        task = asyncio.ensure_future(refresh_tls_on_change(ctx, crt, key, None, poll_s=0.02))

        async def until(cond):
            for _ in range(250):
                await asyncio.sleep(0.02)
                if cond():
                    return
            raise AssertionError("not reloaded")
        try:
            await asyncio.sleep(0.1)  # (the watcher takes its first stamps)
            shutil.copy(pairs["second"][0], key + ".tmp")
            shutil.copy(pairs["second"][1], crt + ".tmp")
            os.replace(key + ".tmp", key)
            os.replace(crt + ".tmp", crt)
            await until(lambda: _served(ctx) == _der(pairs["second"][1]))
            # the third's certificate with the second's key: refused, the second still served
            shutil.copy(pairs["third"][1], crt)
            await until(lambda: "did not load" in caplog.text)
            assert _served(ctx) == _der(pairs["second"][1])
            shutil.copy(pairs["third"][0], key)  # its key follows: now the pair loads
            await until(lambda: _served(ctx) == _der(pairs["third"][1]))
        finally:
            task.cancel()

    with caplog.at_level(logging.INFO, logger="voltllm"):
        asyncio.run(scenario())
    assert "reloaded the TLS certificate" in caplog.text


def test_stamps_follow_links_and_missing_files(tmp_path):
    a, link = tmp_path / "a", tmp_path / "link"
    a.write_text("one")
    link.symlink_to(a)
    before = file_stamps([str(link), str(tmp_path / "missing")])
    assert before[1] is None and before[0] is not None
    b = tmp_path / "b"
    b.write_text("two, longer")
    link.unlink()
    link.symlink_to(b)  # certbot's renewal: the live link moved to a new file
    assert file_stamps([str(link), str(tmp_path / "missing")]) != before
