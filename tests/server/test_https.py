"""`voltllm serve --ssl-certfile/--ssl-keyfile` serves HTTPS (a self-signed certificate made with openssl), with
--ssl-ca-certs / --ssl-cert-reqs 2 only to clients holding a certificate those CAs signed; missing files and a key
without a certificate are refused before any model is loaded."""
from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import time

import httpx
import pytest

from server_helpers import ServerProc, free_port, wait_gone


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    return str(key), str(crt)


def _new_cert(key: str, crt: str, name: str) -> None:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", crt,
                    "-days", "1", "-subj", f"/CN={name}"], check=True, capture_output=True)


def test_serves_https(model_path, cert, tmp_path):
    """HTTPS, and --enable-ssl-refresh: certificate files replaced while serving (as a renewal does: the new pair
    written aside, then moved over the old) are served to the next connections without a restart."""
    key, crt = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    shutil.copy(cert[0], key)
    shutil.copy(cert[1], crt)
    srv = ServerProc([model_path, "--device", "cpu", "--max-model-len", "512", "--num-gpu-blocks-override", "64",
                      "--disable-log-stats", "--ssl-keyfile", key, "--ssl-certfile", crt, "--enable-ssl-refresh"],
                     free_port(), https=True)
    try:
        srv.wait_healthy(300)
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, verify=False, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(srv.base.replace("https://", "http://") + "/health", timeout=5)
        assert "serving" in srv.log_text() and f"https://127.0.0.1:{srv.port}" in srv.log_text()

        served = ssl.get_server_certificate(("127.0.0.1", srv.port))
        assert served.split() == open(crt).read().split()
        _new_cert(str(tmp_path / "key.new"), str(tmp_path / "cert.new"), "renewed")
        os.replace(tmp_path / "key.new", key)
        os.replace(tmp_path / "cert.new", crt)
        deadline = time.monotonic() + 30
        while ssl.get_server_certificate(("127.0.0.1", srv.port)).split() != open(crt).read().split():
            assert time.monotonic() < deadline, "the renewed certificate was not served"
            time.sleep(0.2)
        assert "reloaded the TLS certificate" in srv.log_text()
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, verify=False, timeout=60)
        assert r.status_code == 200
    finally:
        srv.stop()
        assert not wait_gone(srv.descendants, 5)


@pytest.mark.parametrize("extra,match", [(["--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile"),
                                         (["--ssl-keyfile", "/etc/hostname"], "--ssl-keyfile needs --ssl-certfile"),
                                         (["--enable-ssl-refresh"], "--enable-ssl-refresh applies to HTTPS")])
def test_bad_tls_flags_are_refused(extra, match):
    import argparse

    from voltllm.config import ConfigError
    from voltllm.entrypoints.openai.cli_serve import add_parser, check_server_flags

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"), help="serve")
    args = parser.parse_args(["serve", *extra])
    with pytest.raises(ConfigError, match=match):
        check_server_flags(args)


def test_client_certificates_required(model_path, cert, tmp_path):
    """--ssl-cert-reqs 2 with --ssl-ca-certs (vLLM's mutual TLS): a client without a certificate the CA file vouches
    for is refused at the handshake; one with it is served. (A self-signed client certificate is its own CA.)"""
    key, crt = cert
    client_key, client_crt = str(tmp_path / "client.key"), str(tmp_path / "client.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", client_key, "-out",
                    client_crt, "-days", "1", "-subj", "/CN=client"], check=True, capture_output=True)
    srv = ServerProc([model_path, "--device", "cpu", "--max-model-len", "512", "--num-gpu-blocks-override", "64",
                      "--disable-log-stats", "--ssl-keyfile", key, "--ssl-certfile", crt, "--ssl-ca-certs", client_crt,
                      "--ssl-cert-reqs", "2", "--ssl-ciphers", "ECDHE+AESGCM"], free_port(), https=True)
    try:
        deadline = time.monotonic() + 300
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # (the server's certificate is self-signed)
        ctx.load_cert_chain(client_crt, client_key)
        with httpx.Client(verify=ctx, timeout=60) as holder:
            while True:
                assert srv.proc.poll() is None, srv.log_text()[-3000:]
                try:
                    if holder.get(srv.base + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, srv.log_text()[-3000:]
                    time.sleep(0.5)
            r = holder.post(srv.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        srv.descendants = []
        with pytest.raises(httpx.HTTPError):  # no client certificate
            httpx.get(srv.base + "/health", verify=False, timeout=10)
    finally:
        srv.stop()
