"""Remote image fetches against hostile servers: bounded, never in the way, no oracle."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from app.errors import ImageError
from app.pipeline.request import ImagePart, Message
from app.vision.cache import CaptionCache
from app.vision.fetch import is_public_address
from app.vision.images import ImagePolicy, load_image
from app.vision.proxy import VisionProxy
from tests.vision.hostile_servers import NotHttpServer, TrickleServer
from tests.vision.sample_images import data_url, image_bytes

PARAM = "messages[0].content[0].image_url"
GENERIC = f"{PARAM}: could not fetch image"


def loopback(timeout_s: float) -> ImagePolicy:
    """Remote images on, loopback allowed (the hostile servers live there)."""
    return ImagePolicy(allow_remote=True, allow_private_remote=True, remote_timeout_s=timeout_s)


def user(url: str) -> list[Message]:
    return [Message("user", (ImagePart(url, "messages[0].content[0].image_url"),))]


@pytest.fixture(scope="module")
def trickle():
    # A byte every 0.2 s: far inside any per-read timeout, for longer than any test waits.
    with TrickleServer(interval=0.2, for_s=8.0) as server:
        yield server


@pytest.mark.parametrize("path", ["/headers", "/body"])
def test_the_timeout_bounds_the_whole_fetch(trickle, path):
    started = time.monotonic()
    with pytest.raises(ImageError) as info:
        load_image(trickle.url(path), loopback(1.0), param=PARAM)
    took = time.monotonic() - started
    assert info.value.message == GENERIC
    assert info.value.param == PARAM
    assert 0.9 <= took < 2.0, f"a 1 s timeout took {took:.1f} s"
    assert trickle.wait_idle(2.0), "the fetch gave up but left its connection open"


def test_stuck_fetches_do_not_hold_up_other_requests_images(trickle):
    # More stuck fetches than asyncio's default thread pool has threads (min(32, cpus + 4)).
    stuck = min(32, (os.cpu_count() or 1) + 4)
    proxy = VisionProxy(None, CaptionCache(), loopback(3.0))

    async def scenario():
        fetches = [
            asyncio.create_task(proxy.rewrite(user(trickle.url("/headers")))) for _ in range(stuck)
        ]
        await asyncio.sleep(0.3)
        started = time.monotonic()
        result = await proxy.rewrite(user(data_url(image_bytes())))
        took = time.monotonic() - started
        return took, result, await asyncio.gather(*fetches, return_exceptions=True)

    took, result, errors = asyncio.run(scenario())
    assert took < 1.0, f"a data: URL waited {took:.1f} s behind {stuck} stuck fetches"
    assert "Image 1: not available" in result.messages[0].text()
    assert all(isinstance(e, ImageError) and e.message == GENERIC for e in errors), errors


def test_shutdown_does_not_wait_for_a_stuck_fetch(trickle):
    proxy = VisionProxy(None, CaptionCache(), loopback(30.0))

    async def serve_then_stop():
        asyncio.create_task(proxy.rewrite(user(trickle.url("/body"))))
        await asyncio.sleep(0.3)

    started = time.monotonic()
    # Returning with the fetch in flight: asyncio.run cancels it and closes the loop,
    # the last steps of a server's exit on SIGTERM.
    asyncio.run(serve_then_stop())
    took = time.monotonic() - started
    assert took < 1.5, f"the loop took {took:.1f} s to close behind a stuck fetch"
    assert trickle.wait_idle(2.0), "the cancelled fetch left its connection open"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def not_http():
    with NotHttpServer() as server:
        yield server


@pytest.mark.parametrize(
    "case", ["refused", "timed out", "not HTTP", "TLS to plain HTTP", "unresolvable", "no route"]
)
def test_network_failures_all_read_the_same(case, trickle, not_http):
    """One message for every way a fetch fails, so a client cannot port-scan through us."""
    url = {
        "refused": f"http://127.0.0.1:{_closed_port()}/a.png",
        "timed out": trickle.url("/headers"),
        "not HTTP": f"http://127.0.0.1:{not_http.port}/a.png",
        "TLS to plain HTTP": trickle.url("/headers").replace("http:", "https:"),
        "unresolvable": "http://no-such-host.invalid/a.png",
        "no route": "http://192.0.2.1/a.png",  # TEST-NET-1: never routed
    }[case]
    with pytest.raises(ImageError) as info:
        load_image(url, loopback(0.5), param=PARAM)
    assert info.value.message == GENERIC
    assert info.value.status_code == 400


@pytest.mark.parametrize(
    "host",
    [
        "[64:ff9b::a00:1]",  # NAT64 of 10.0.0.1
        "[64:ff9b::7f00:1]",  # NAT64 of 127.0.0.1
        "[64:ff9b::a9fe:a9fe]",  # NAT64 of 169.254.169.254, the cloud metadata endpoint
        "[64:ff9b:1::a00:1]",  # local-use NAT64 prefix (RFC 8215)
        "[2002:a00:1::1]",  # 6to4 of 10.0.0.1
        "[2002:7f00:1::1]",  # 6to4 of 127.0.0.1
        "[::a00:1]",  # IPv4-compatible 10.0.0.1
        "[::ffff:c0a8:1]",  # IPv4-mapped 192.168.0.1
    ],
)
def test_ipv6_carrying_a_private_ipv4_is_refused_without_connecting(host):
    policy = ImagePolicy(allow_remote=True, remote_timeout_s=0.5)
    with pytest.raises(ImageError, match="non-public address") as info:
        load_image(f"http://{host}/a.png", policy, param=PARAM)
    assert info.value.param == PARAM


@pytest.mark.parametrize(
    "address,public",
    [
        ("8.8.8.8", True),
        ("2607:f8b0:4004:800::200e", True),
        ("64:ff9b::808:808", True),  # NAT64 of a public address
        ("2002:808:808::1", True),  # 6to4 of a public address
        ("64:ff9b::a00:1", False),
        ("2002:c0a8:1::1", False),
        ("fe80::1%eth0", False),
        ("100.64.0.1", False),  # carrier-grade NAT
    ],
)
def test_public_address_classifier(address, public):
    assert is_public_address(address) is public
