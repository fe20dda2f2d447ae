"""load_image: every way an image URL can be bad gives an ImageError naming the part."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO
from pathlib import Path

import pytest
from PIL import ExifTags, Image, ImageOps

from app.errors import ImageError
from app.vision.images import ImagePolicy, decode_image, downscale, load_image
from tests.conftest import REPO
from tests.vision.sample_images import (
    data_url,
    image_bytes,
    mpo_bytes,
    png16_gray,
    png16_rgba,
    png_claiming_size,
)

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


def test_multi_picture_jpeg_reads_its_first_frame():
    """iPhone HDR gain-map photos and 3D-camera files are MPO: a JPEG plus more pictures."""
    raw = mpo_bytes(first=(0, 0, 255), second=(255, 0, 0))
    loaded = load_image(data_url(raw, "image/jpeg"), POLICY, param=PARAM)
    assert loaded.format == "jpeg"
    assert loaded.size == (40, 30)
    red, _, blue = loaded.image.getpixel((20, 15))
    assert blue > 200 and red < 50, "the first picture, not the second"


def test_16_bit_pngs_become_8_bit_rgb_without_clipping():
    grey = load_image(data_url(png16_gray(0x8000)), POLICY, param=PARAM)
    assert grey.image.mode == "RGB"
    assert grey.image.getpixel((0, 0)) == (128, 128, 128), "mid-grey, not clipped to white"
    rgba = load_image(data_url(png16_rgba(64, 8)), POLICY, param=PARAM)
    assert rgba.image.mode == "RGB"
    assert rgba.image.getpixel((0, 0)) == (0, 255, 0)


@pytest.mark.parametrize(
    "fmt,mode,colour,expected",
    [
        ("png", "RGB", (0, 0, 255), (0, 0, 255)),
        ("jpeg", "RGB", (0, 0, 255), (0, 0, 255)),
        ("webp", "RGB", (0, 0, 255), (0, 0, 255)),
        ("gif", "RGB", (0, 0, 255), (0, 0, 255)),
        ("png", "RGBA", (0, 0, 0, 0), (255, 255, 255)),
        ("png", "P", 3, None),
    ],
    ids=["png", "jpeg", "webp", "gif", "transparent png", "palette png"],
)
def test_decoding_shrinks_to_max_pixels_at_once(fmt, mode, colour, expected):
    raw = image_bytes(colour, (1200, 900), fmt, mode)
    loaded = decode_image(raw, POLICY, param=PARAM, max_pixels=200 * 150)
    assert loaded.size == (1200, 900), "size is the source's"
    assert loaded.image.mode == "RGB"
    assert loaded.image.size == downscale(Image.new("RGB", (1200, 900)), 200 * 150).size
    full = decode_image(raw, POLICY, param=PARAM).image
    assert full.size == (1200, 900)
    expected = expected or full.getpixel((0, 0))
    for x, y in [(0, 0), (100, 75), (199, 149)]:
        assert all(abs(a - b) <= 8 for a, b in zip(loaded.image.getpixel((x, y)), expected))


def test_exif_orientation_is_applied_to_the_shrunk_picture():
    picture = Image.new("RGB", (400, 200), (255, 0, 0))
    picture.paste((0, 0, 255), (200, 0, 400, 200))
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # shown turned a quarter clockwise
    buf = BytesIO()
    picture.save(buf, format="JPEG", exif=exif)
    upright = ImageOps.exif_transpose(Image.open(BytesIO(buf.getvalue()))).convert("RGB")
    for max_pixels in (None, 50 * 100):
        loaded = decode_image(buf.getvalue(), POLICY, param=PARAM, max_pixels=max_pixels)
        assert loaded.size == upright.size == (200, 400)
        w, h = loaded.image.size
        assert h == 2 * w
        for fy in (0.25, 0.75):
            want = upright.getpixel((upright.width // 2, int(upright.height * fy)))
            got = loaded.image.getpixel((w // 2, int(h * fy)))
            assert all(abs(a - b) <= 40 for a, b in zip(got, want)), (fy, got, want)


needs_proc = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="reads peak RSS from /proc"
)


def decode_peak(tmp_path: Path, raw: bytes, max_pixels: int) -> dict:
    path = tmp_path / "image"
    path.write_bytes(raw)
    out = subprocess.run(
        [sys.executable, "-m", "tests.vision.decode_peak", str(path), str(max_pixels)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_proc
def test_a_big_jpeg_decodes_at_reduced_scale(tmp_path):
    picture = Image.linear_gradient("L").resize((6000, 4000)).convert("RGB")
    buf = BytesIO()
    picture.save(buf, format="JPEG", quality=85)
    del picture
    peak = decode_peak(tmp_path, buf.getvalue(), 448 * 448)
    full_mb = 6000 * 4000 * 4 / 2**20  # Pillow keeps RGB in 4 bytes a pixel: 92 MB
    assert peak["rise_mb"] < full_mb / 4, f"{peak['rise_mb']} MB for a 24 MP JPEG"
    assert peak["size"][0] * peak["size"][1] <= 448 * 448


@needs_proc
def test_a_16_bit_png_costs_little_more_than_its_decoded_pixels(tmp_path):
    peak = decode_peak(tmp_path, png16_rgba(6300, 6300), 448 * 448)
    decoded_mb = 6300 * 6300 * 4 / 2**20  # Pillow reads 16-bit RGBA as 8-bit RGBA: 151 MB
    assert peak["rise_mb"] < decoded_mb * 1.25, f"{peak['rise_mb']} MB for {decoded_mb:.0f} MB"
    assert peak["size"] == [448, 448]


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


def test_a_name_resolving_to_a_private_address_reads_as_any_network_failure(caplog):
    """It said "resolves to a non-public address": a caller could map which names resolve
    inside. Now it reads as a name that does not resolve at all; the log keeps the cause."""
    policy = ImagePolicy(allow_remote=True, remote_timeout_s=5)
    messages = []
    for url in ("http://localhost:9/a.png", "http://no-such-host.invalid/a.png"):
        with pytest.raises(ImageError) as err, caplog.at_level(logging.INFO, logger="tandem.vision"):
            load_image(url, policy, param=PARAM)
        messages.append(err.value.message)
    assert messages == [f"{PARAM}: could not fetch image"] * 2
    assert "localhost resolves to a non-public address" in caplog.text


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

    def do_GET(self):
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
            try:
                for _ in range(64):
                    self.wfile.write(b"\0" * 1024)
            except ConnectionError:
                pass  # the client stopped reading at its cap
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
