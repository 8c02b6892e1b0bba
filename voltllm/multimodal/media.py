"""An image or video part's source -> its bytes (an image decoded to a PIL RGB image here; a video by video.py):
`data:image/...;base64,` (`data:video/...;base64,`) URLs always, `http(s)://` URLs fetched (within
--allowed-media-domains when given), `file://` URLs only under --allowed-local-media-path (vLLM's rules). Every
failure is a MediaError, which the server answers with a 400."""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import os
from dataclasses import dataclass
from typing import Optional
from urllib.parse import unquote, urljoin, urlsplit

from PIL import Image

FETCH_TIMEOUT_S = 5.0  # vLLM's image fetch timeout
MAX_IMAGE_BYTES = 32 << 20  # an encoded image (fetched, read or decoded from base64) larger than this is refused
MAX_REDIRECTS = 5
MAX_IMAGE_PIXELS = 1 << 26  # 67 Mpx (8192 x 8192): decoded, more would take gigabytes before any resize
VIDEO_FETCH_TIMEOUT_S = 30.0  # vLLM's video fetch timeout
MAX_VIDEO_BYTES = 256 << 20  # an encoded video larger than this is refused


class MediaError(ValueError):
    """An image source that cannot be read (the message says why); a 400 in the HTTP API."""


@dataclass(frozen=True)
class MediaSettings:
    allowed_local_media_path: Optional[str] = None  # a directory (real path); None: file:// URLs refused
    allowed_media_domains: Optional[tuple[str, ...]] = None  # host names http(s) URLs may name; None: any
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES
    kind: str = "image"  # what the URLs name: image | video (the data URL type, the messages)

    def for_videos(self) -> "MediaSettings":
        """The same rules for video URLs: vLLM's longer fetch timeout, a larger size cap."""
        from dataclasses import replace

        return replace(self, fetch_timeout_s=VIDEO_FETCH_TIMEOUT_S, max_bytes=MAX_VIDEO_BYTES, kind="video")


def load_image(url: str, settings: MediaSettings = MediaSettings()) -> Image.Image:
    """The image a part's URL names, decoded and converted to RGB."""
    return decode_image(read_media(url, settings), _short(url))


def read_media(url: str, settings: MediaSettings = MediaSettings()) -> bytes:
    """The encoded bytes a part's URL names (an image, or a video with settings.for_videos())."""
    kind = settings.kind
    if not isinstance(url, str) or not url:
        raise MediaError(f"an {kind} URL must be a non-empty string" if kind == "image" else
                         f"a {kind} URL must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(url, settings.max_bytes, kind)
    if scheme in ("http", "https"):
        return _fetch(url, settings)
    if scheme == "file":
        return _read_local(url, settings)
    raise MediaError(f"{kind} URL {_short(url)}: expected a data:{kind}/...;base64, URL, an http(s):// URL or a "
                     "file:// URL")


def decode_image(data: bytes, what: str = "the image") -> Image.Image:
    """Encoded image bytes (PNG, JPEG, WebP, ... whatever Pillow reads) -> an RGB image; transparency over white.
    More than MAX_IMAGE_PIXELS is refused before the pixels are decoded (a small file can hold a huge image)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise MediaError(f"{what}: {im.width} x {im.height} pixels is more than {MAX_IMAGE_PIXELS} are taken")
            im.load()
            if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
                rgba = im.convert("RGBA")
                out = Image.new("RGB", rgba.size, (255, 255, 255))
                out.paste(rgba, mask=rgba.getchannel("A"))
                return out
            return im.convert("RGB")
    except Image.DecompressionBombError as e:
        raise MediaError(f"{what}: too many pixels ({e})") from None
    except (OSError, ValueError, SyntaxError) as e:  # (UnidentifiedImageError is an OSError)
        raise MediaError(f"{what} is not an image Pillow can read: {e}") from None


def _data_url_bytes(url: str, max_bytes: int, kind: str = "image") -> bytes:
    example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
    head, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"a data URL needs a ',' before its data ({example})")
    kinds = head[len("data:"):].split(";")
    if not kinds[0].lower().startswith(f"{kind}/"):
        raise MediaError(f"data URL of type {kinds[0] or 'text/plain'!r}: only {kind}/* data URLs are taken here")
    if kind == "video" and kinds[0].lower() == "video/jpeg":
        raise MediaError("video/jpeg data URLs (frames as JPEG images) are not taken: send the video file itself "
                         "(data:video/mp4;base64,...)")
    if "base64" not in (k.lower() for k in kinds[1:]):
        raise MediaError(f"a{'n' if kind == 'image' else ''} {kind} data URL must be base64-encoded ({example})")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise MediaError(f"the {kind} is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the {kind} data URL is not valid base64: {e}") from None


def _fetch(url: str, settings: MediaSettings) -> bytes:
    """GET the URL with a size cap, the whole fetch (redirects and a server that drips its answer included) within
    settings.fetch_timeout_s; redirects are followed by hand, so that each host is checked. It runs on an event loop
    of its own, on a thread of its own (the caller may be inside a loop), and is cancelled at the deadline."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _fetch_within(url, settings)).result()


async def _fetch_within(url: str, settings: MediaSettings) -> bytes:
    try:
        return await asyncio.wait_for(_fetch_async(url, settings), settings.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise MediaError(f"fetching the {settings.kind} {_short(url)} took more than "
                         f"{settings.fetch_timeout_s:g} s") from None


async def _fetch_async(url: str, settings: MediaSettings) -> bytes:
    import httpx

    kind = settings.kind
    async with httpx.AsyncClient(timeout=settings.fetch_timeout_s, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_domain(url, settings.allowed_media_domains, kind)
            try:
                async with client.stream("GET", url) as r:
                    if r.is_redirect and "location" in r.headers:
                        url = urljoin(url, r.headers["location"])
                        continue
                    if r.status_code != 200:
                        raise MediaError(f"fetching the {kind} {_short(url)} failed: HTTP {r.status_code}")
                    declared = r.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > settings.max_bytes:
                        raise MediaError(f"the {kind} {_short(url)} is larger than {settings.max_bytes} bytes")
                    chunks, size = [], 0
                    async for chunk in r.aiter_bytes():
                        size += len(chunk)
                        if size > settings.max_bytes:
                            raise MediaError(f"the {kind} {_short(url)} is larger than {settings.max_bytes} bytes")
                        chunks.append(chunk)
                    return b"".join(chunks)
            except MediaError:
                raise
            except httpx.TimeoutException:
                raise MediaError(f"fetching the {kind} {_short(url)} took more than "
                                 f"{settings.fetch_timeout_s:g} s") from None
            except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:  # (ValueError: a URL httpx cannot parse)
                raise MediaError(f"fetching the {kind} {_short(url)} failed: {e}") from None
    raise MediaError(f"fetching the {kind} {_short(url)} failed: more than {MAX_REDIRECTS} redirects")


def _check_domain(url: str, allowed: Optional[tuple[str, ...]], kind: str = "image") -> None:
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError as e:  # (e.g. an unclosed IPv6 bracket)
        raise MediaError(f"{kind} URL {_short(url)} is not a URL: {e}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(f"{kind} URL {_short(url)}: only http(s) URLs are fetched (a redirect led elsewhere)")
    if not host:
        raise MediaError(f"{kind} URL {_short(url)} names no host")
    if allowed is not None and host not in allowed:
        raise MediaError(f"{kind} URL {_short(url)}: the host {host!r} is not one of the server's "
                         f"--allowed-media-domains ({', '.join(allowed)})")


def _read_local(url: str, settings: MediaSettings) -> bytes:
    root = settings.allowed_local_media_path
    if root is None:
        raise MediaError(f"file:// {settings.kind} URLs are refused: the server reads local files only under "
                         "--allowed-local-media-path")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"{settings.kind} URL {_short(url)}: a file:// URL must name a local path (file:///path)")
    try:
        path = os.path.realpath(unquote(parts.path))
    except ValueError as e:  # (an embedded NUL)
        raise MediaError(f"{settings.kind} URL {_short(url)} is not a file path: {e}") from None
    if os.path.commonpath([path, root]) != root:
        raise MediaError(f"{settings.kind} file {unquote(parts.path)!r} is not under the server's "
                         "--allowed-local-media-path")
    try:
        if os.path.getsize(path) > settings.max_bytes:
            raise MediaError(f"{settings.kind} file {unquote(parts.path)!r} is larger than {settings.max_bytes} bytes")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise MediaError(f"cannot read {settings.kind} file {unquote(parts.path)!r}: {e.strerror or e}") from None


def _short(url: str) -> str:
    """A URL as errors show it (a data URL's payload left out)."""
    if url[:5].lower() == "data:":
        return url.split(",", 1)[0] + ",..."
    return repr(url if len(url) <= 200 else url[:200] + "...")
