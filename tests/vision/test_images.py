"""load_image: every way an image URL can be bad gives an ImageError naming the part."""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from app.errors import ImageError
from app.vision.images import ImagePolicy, downscale, load_image
from tests.vision.sample_images import data_url, image_bytes, png_claiming_size

PARAM = "messages[1].content[2].image_url"
POLICY = ImagePolicy()


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp", "gif"])
def test_data_url_formats_decode_to_rgb(fmt):
    raw = image_bytes((0, 0, 255), (40, 30), fmt)
    loaded = load_image(data_url(raw, f"image/{fmt}"), POLICY, param=PARAM)
    assert loaded.format == fmt
    assert loaded.size == (40, 30)
    assert loaded.image.mode == "RGB"
    assert loaded.sha256 == hashlib.sha256(raw).hexdigest()
    assert loaded.num_bytes == len(raw)


def test_transparent_pixels_become_white_and_base64_may_be_wrapped():
    raw = image_bytes((0, 0, 0, 0), (8, 8), "png", mode="RGBA")
    b64 = base64.b64encode(raw).decode()
    wrapped = "\n".join(b64[i : i + 20] for i in range(0, len(b64), 20))
    loaded = load_image(f"data:image/png;base64,{wrapped}", POLICY, param=PARAM)
    assert loaded.image.getpixel((0, 0)) == (255, 255, 255)


PNG = image_bytes()
BAD_DATA_URLS = {
    "garbage base64": ("data:image/png;base64,!!!not*base64!!!", "not valid base64"),
    "not an image": (data_url(b"hello, this is text"), "not a supported image"),
    "bmp is not accepted": (data_url(image_bytes(fmt="bmp")), "not a supported image"),
    "truncated": (data_url(image_bytes(size=(64, 64), fmt="jpeg")[:300]), "truncated"),
    "unsupported mime": (data_url(PNG, "image/bmp"), "unsupported image type"),
    "text mime": (data_url(PNG, "text/plain"), "unsupported image type"),
    "not base64 encoded": ("data:image/png,rawbytes", "must be base64"),
    "no comma": ("data:image/png;base64", "malformed data URL"),
    "decode bomb (header only)": (data_url(png_claiming_size(20_000, 20_000)), "pixels"),
    "over max_pixels": (data_url(png_claiming_size(8_000, 6_000)), "pixels"),
    "ftp scheme": ("ftp://example.com/a.png", "unsupported image URL scheme"),
    "no scheme": ("just-a-string", "unsupported image URL scheme"),
    "javascript scheme": ("javascript:alert(1)", "unsupported image URL scheme"),
    "empty": ("   ", "non-empty"),
}


@pytest.mark.parametrize("url,expected", BAD_DATA_URLS.values(), ids=BAD_DATA_URLS.keys())
def test_bad_image_gives_image_error_naming_the_part(url, expected):
    with pytest.raises(ImageError) as info:
        load_image(url, POLICY, param=PARAM)
    err = info.value
    assert err.param == PARAM
    assert err.status_code == 400
    assert PARAM in err.message
    assert expected in err.message


def test_too_many_bytes_is_refused_before_decoding():
    raw = image_bytes(size=(64, 64))
    with pytest.raises(ImageError) as info:
        load_image(data_url(raw), ImagePolicy(max_image_bytes=len(raw) - 10), param=PARAM)
    assert info.value.code == "image_too_large"
    assert info.value.param == PARAM


# -- file:// ------------------------------------------------------------------


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    root.mkdir()
    (root / "cat photo.png").write_bytes(image_bytes((0, 255, 0)))
    (tmp_path / "secret.png").write_bytes(image_bytes((1, 2, 3)))
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    return root


def test_file_urls_are_off_by_default(image_dir):
    with pytest.raises(ImageError, match="disabled"):
        load_image(f"file://{image_dir}/cat%20photo.png", POLICY, param=PARAM)


def test_file_url_under_allowed_dir_loads(image_dir):
    policy = ImagePolicy(allowed_file_dir=image_dir)
    loaded = load_image(f"file://{image_dir}/cat%20photo.png", policy, param=PARAM)
    assert loaded.image.getpixel((0, 0)) == (0, 255, 0)


@pytest.mark.parametrize(
    "relative",
    ["../secret.png", "link.png", "missing.png", "."],
    ids=["dotdot", "symlink", "missing", "dir"],
)
def test_file_url_escapes_and_misses_are_refused_alike(image_dir, relative):
    policy = ImagePolicy(allowed_file_dir=image_dir)
    with pytest.raises(ImageError, match="no readable image file") as info:
        load_image(f"file://{image_dir}/{relative}", policy, param=PARAM)
    assert info.value.param == PARAM


def test_file_url_with_remote_host_is_refused(image_dir):
    policy = ImagePolicy(allowed_file_dir=image_dir)
    with pytest.raises(ImageError, match="local path"):
        load_image(f"file://server{image_dir}/cat%20photo.png", policy, param=PARAM)


# -- http(s):// ---------------------------------------------------------------


def test_remote_urls_are_off_by_default():
    with pytest.raises(ImageError, match="remote image URLs are disabled") as info:
        load_image("https://example.com/cat.png", POLICY, param=PARAM)
    assert info.value.param == PARAM


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/a.png",
        "http://localhost:9/a.png",
        "http://[::1]:9/a.png",
        "http://10.1.2.3/a.png",
        "http://192.168.0.10/a.png",
        "http://169.254.169.254/latest/meta-data",  # cloud metadata endpoint
        "http://0.0.0.0/a.png",
    ],
)
def test_private_addresses_are_refused_without_connecting(url):
    policy = ImagePolicy(allow_remote=True)
    with pytest.raises(ImageError, match="non-public address"):
        load_image(url, policy, param=PARAM)


@pytest.mark.parametrize("url", ["http://127.0.0.1:port/a.png", "http://[::1/a.png"])
def test_malformed_remote_url(url):
    with pytest.raises(ImageError, match="malformed image URL"):
        load_image(url, ImagePolicy(allow_remote=True), param=PARAM)


def test_host_not_in_allow_list_is_refused_before_any_lookup():
    policy = ImagePolicy(allow_remote=True, remote_allow_hosts=("*.example.org",))
    with pytest.raises(ImageError, match="not allowed"):
        load_image("https://images.example.com/a.png", policy, param=PARAM)


class _Handler(BaseHTTPRequestHandler):
    last_host: str | None = None

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            type(self).last_host = self.headers["Host"]
            body = image_bytes((9, 9, 9))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        elif self.path == "/big":
            self.send_response(200)  # no Content-Length: the cap must hold while streaming
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 1024)
        elif self.path == "/slow":
            time.sleep(1.0)
            self.send_response(200)
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def local_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


LOCAL = ImagePolicy(
    allow_remote=True,
    allow_private_remote=True,
    remote_allow_hosts=("127.0.0.1",),
    remote_timeout_s=0.3,
    remote_max_bytes=16 * 1024,
)


def test_remote_fetch_on_loopback_when_explicitly_allowed(local_server):
    loaded = load_image(f"{local_server}/cat.png", LOCAL, param=PARAM)
    assert loaded.image.getpixel((0, 0)) == (9, 9, 9)
    assert _Handler.last_host == local_server.removeprefix("http://")


def test_https_goes_through_tls(local_server):
    # The local server speaks plain HTTP, so the TLS handshake must fail cleanly.
    url = local_server.replace("http://", "https://") + "/cat.png"
    with pytest.raises(ImageError, match="could not fetch image"):
        load_image(url, LOCAL, param=PARAM)


@pytest.mark.parametrize(
    "path,expected",
    [
        ("/redirect", "redirects are not followed"),
        ("/missing", "HTTP 404"),
        ("/big", "over the limit"),
        ("/slow", "could not fetch image"),
    ],
)
def test_remote_fetch_failures(local_server, path, expected):
    with pytest.raises(ImageError, match=expected) as info:
        load_image(f"{local_server}{path}", LOCAL, param=PARAM)
    assert info.value.param == PARAM


# -- downscale ----------------------------------------------------------------


def test_downscale_keeps_aspect_ratio_within_bounds():
    from PIL import Image

    big = Image.new("RGB", (4000, 1000))
    small = downscale(big, max_pixels=100_000)
    assert small.size[0] * small.size[1] <= 100_000
    assert abs(small.size[0] / small.size[1] - 4.0) < 0.05

    tiny = Image.new("RGB", (10, 5))
    lifted = downscale(tiny, max_pixels=100_000, min_pixels=5_000)
    assert lifted.size[0] * lifted.size[1] >= 5_000
    assert abs(lifted.size[0] / lifted.size[1] - 2.0) < 0.05

    fits = Image.new("RGB", (100, 100))
    assert downscale(fits, max_pixels=100_000, min_pixels=100) is fits
