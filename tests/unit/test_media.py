"""voltllm.multimodal.media: image sources -> RGB images, and the refusals (no network: http through a local
http.server thread)."""
from __future__ import annotations

import base64
import http.server
import time
import io
import os
import threading

import pytest
from PIL import Image

from voltllm.multimodal.media import MediaError, MediaSettings, load_image


def png_bytes(color=(200, 10, 30), size=(5, 3), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def test_data_url_decodes_to_rgb():
    im = load_image(data_url(png_bytes()))
    assert im.mode == "RGB" and im.size == (5, 3) and im.getpixel((0, 0)) == (200, 10, 30)


def test_transparency_goes_over_white():
    im = load_image(data_url(png_bytes((0, 0, 0, 0), mode="RGBA")))
    assert im.mode == "RGB" and im.getpixel((1, 1)) == (255, 255, 255)


@pytest.mark.parametrize("url, why", [
    ("http://[::1", "is not a URL"),
    ("http://xn--/x", "failed"),
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    (data_url(b"these bytes are no picture"), "not an image"),
    ("data:text/plain;base64,aGk=", r"only image/\* data URLs"),
    ("data:image/png,rawbytes", "base64-encoded"),
    ("ftp://example.com/a.png", "expected a data:image"),
    ("", "non-empty"),
])
def test_bad_sources_are_media_errors(url, why):
    with pytest.raises(MediaError, match=why):
        load_image(url)


def test_too_large_data_url_refused():
    with pytest.raises(MediaError, match="larger than 100 bytes"):
        load_image(data_url(png_bytes(size=(64, 64)) + b"\0" * 200), MediaSettings(max_bytes=100))


def test_file_urls_only_under_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    settings = MediaSettings(allowed_local_media_path=os.path.realpath(allowed))
    assert load_image(f"file://{allowed}/a.png", settings).size == (5, 3)
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        load_image(f"file://{allowed}/a.png")  # (no allowed path: every file URL refused)
    with pytest.raises(MediaError, match="not under the server's --allowed-local-media-path"):
        load_image(f"file://{tmp_path}/secret.png", settings)
    with pytest.raises(MediaError, match="not under"):  # (.. does not climb out)
        load_image(f"file://{allowed}/../secret.png", settings)
    with pytest.raises(MediaError, match="cannot read"):
        load_image(f"file://{allowed}/missing.png", settings)


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):
        if self.path == "/drip":  # a header line a second, for ever: only a total deadline ends it
            self.send_response(200)
            try:
                for i in range(60):
                    self.send_header(f"X-Drip-{i}", "1")
                    self.flush_headers()
                    time.sleep(0.5)
            except OSError:
                pass
            return
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_base():
    _Handler.routes = {"/a.png": (200, {"Content-Type": "image/png"}, png_bytes()),
                       "/big.png": (200, {}, png_bytes() + b"\0" * 5000),
                       "/text": (200, {}, b"hello"),
                       "/to-a": (302, {"Location": "/a.png"}, b""),
                       "/away": (302, {"Location": "http://localhost:1/a.png"}, b"")}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_fetch(http_base):
    assert load_image(f"{http_base}/a.png").getpixel((0, 0)) == (200, 10, 30)
    assert load_image(f"{http_base}/to-a").size == (5, 3)  # (a redirect is followed)


def test_http_failures(http_base):
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{http_base}/missing.png")
    with pytest.raises(MediaError, match="not an image"):
        load_image(f"{http_base}/text")
    with pytest.raises(MediaError, match="larger than 1000 bytes"):
        load_image(f"{http_base}/big.png", MediaSettings(max_bytes=1000))
    with pytest.raises(MediaError, match="failed"):  # (nothing listens on port 1)
        load_image("http://127.0.0.1:1/a.png", MediaSettings(fetch_timeout_s=2))


def test_allowed_media_domains(http_base):
    only_local = MediaSettings(allowed_media_domains=("127.0.0.1",))
    assert load_image(f"{http_base}/a.png", only_local).size == (5, 3)
    with pytest.raises(MediaError, match="not one of the server's --allowed-media-domains"):
        load_image("http://example.com/a.png", only_local)
    # a redirect to another host is checked too, before anything is fetched from it
    with pytest.raises(MediaError, match="'localhost' is not one of"):
        load_image(f"{http_base}/away", only_local)


def test_a_dripping_server_is_cut_at_the_total_deadline(http_base):
    t0 = time.monotonic()
    with pytest.raises(MediaError, match="took more than 1 s"):
        load_image(f"{http_base}/drip", MediaSettings(fetch_timeout_s=1))
    assert time.monotonic() - t0 < 3


def test_huge_images_refused_before_decoding(monkeypatch, tmp_path):
    """A small file can hold a huge image: more than MAX_IMAGE_PIXELS is refused from its header."""
    import voltllm.multimodal.media as media

    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(MediaError, match="5 x 30 pixels is more than 100"):
        load_image(data_url(png_bytes(size=(5, 30))))
    assert load_image(data_url(png_bytes(size=(5, 20)))).size == (5, 20)
    with pytest.raises(MediaError, match="not a file path"):
        load_image("file:///tmp/a%00b.png", MediaSettings(allowed_local_media_path=str(tmp_path)))
