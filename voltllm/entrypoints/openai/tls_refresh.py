"""vLLM's `--enable-ssl-refresh`: the server's TLS certificate (and key, and client CAs) reloaded when their files
change, so a renewed certificate (certbot swapping its symlinks, a secret remounted) is served without a restart.

The files are polled (their inode, size and mtime, links followed); on a change the live ssl.SSLContext uvicorn built
loads them again: handshakes from then on get the new certificate, open connections keep theirs. A reload that fails
(files caught half-written, a key that does not match) is logged and the old certificate kept; the next change is
tried again. Client CAs (--ssl-ca-certs) are added to those the context trusts: one taken out of the file stays
trusted until a restart (an ssl.SSLContext cannot forget a CA).
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
import tempfile
from typing import Optional, Sequence

logger = logging.getLogger("voltllm")

POLL_S = 1.0


def file_stamps(paths: Sequence[str]) -> tuple:
    """What changes when a file is rewritten or replaced (None for one that is missing for now)."""
    stamps = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            stamps.append(None)
            continue
        stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def reload_tls(context: ssl.SSLContext, certfile: str, keyfile: Optional[str], ca_certs: Optional[str],
               password: Optional[str] = None) -> None:
    """Load the certificate chain (and the client CAs) into the live context again; raises what ssl raises, the
    live context untouched then. The files are copied once (into a private directory) and the copies tried on a
    scratch context first: a pair that fails half-way (a certificate in, its key refused) would otherwise leave the
    live context holding a certificate without its key, refusing every handshake."""
    with tempfile.TemporaryDirectory(prefix="voltllm-tls-") as d:  # (mode 0700: the key's copy stays private)
        cert, key, ca = (_copy(p, d, name) for p, name in ((certfile, "cert"), (keyfile, "key"), (ca_certs, "ca")))
        for ctx in (ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), context):
            ctx.load_cert_chain(cert, key, password)
            if ca:
                ctx.load_verify_locations(ca)


def _copy(path: Optional[str], folder: str, name: str) -> Optional[str]:
    if not path:
        return None
    dst = os.path.join(folder, name)
    shutil.copyfile(path, dst)
    return dst


async def refresh_tls_on_change(context: ssl.SSLContext, certfile: str, keyfile: Optional[str],
                                ca_certs: Optional[str], password: Optional[str] = None,
                                poll_s: float = POLL_S) -> None:
    """Run until cancelled: reload the context whenever the files' stamps change."""
    paths = [p for p in (certfile, keyfile, ca_certs) if p]
    seen = file_stamps(paths)
    while True:
        await asyncio.sleep(poll_s)
        now = file_stamps(paths)
        if now == seen or None in now:  # (a file being replaced: wait until it is there)
            continue
        seen = now
        try:
            reload_tls(context, certfile, keyfile, ca_certs, password)
        except (OSError, ssl.SSLError, ValueError) as e:
            logger.warning("--enable-ssl-refresh: the changed TLS files did not load (%s: %s); still serving the "
                           "previous certificate", type(e).__name__, e)
        else:
            logger.info("--enable-ssl-refresh: reloaded the TLS certificate from %s", certfile)
