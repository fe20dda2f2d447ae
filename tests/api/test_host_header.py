"""The Host check parses the header strictly (DNS rebinding).

It took the text before the last ':' or inside the first '[...]' as the name, so
``[::1].evil`` and ``127.0.0.1:80@evil`` passed as loopback names."""

from __future__ import annotations

import httpx
import pytest

from tests.api.serving import assert_openai_error, serving, tiny_yaml


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir):
    with serving(tmp_path_factory.mktemp("host"), tiny_yaml(tiny_model_dir)) as served:
        yield served


@pytest.mark.parametrize("host", ["[::1].evil", "[::1].evil:8000", "127.0.0.1:80@evil", "127.0.0.1:80@evil.com:80",
                                  "localhost:80@evil", "[::1]evil", "[::1]:80:80", "localhost:", "localhost:port",
                                  "[::1", "", "user@localhost"])
def test_malformed_loopback_look_alikes_are_refused(srv, host):
    r = httpx.get(srv.base_url + "/v1/models", headers={"host": host}, timeout=30)
    assert_openai_error(r, 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "127.0.0.1", "[::1]", "[::1]:{port}", "localhost:{port}",
                                  "127.0.0.1:{port}"])
def test_loopback_names_with_or_without_a_port_are_served(srv, host):
    port = srv.base_url.rsplit(":", 1)[1]
    r = httpx.get(srv.base_url + "/v1/models", headers={"host": host.format(port=port)}, timeout=30)
    assert r.status_code == 200, r.text
