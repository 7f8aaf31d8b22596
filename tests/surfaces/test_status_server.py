"""Status endpoint: every route's shape and status, served from a fake daemon snapshot."""

from __future__ import annotations

import re

import aiohttp
import pytest

from agora_node.node.metrics import Metrics
from agora_node.node.status_server import PortInUseError, StatusServer

from .conftest import SELF_ID, FakeDaemon

pytestmark = pytest.mark.timeout(60)


async def get(server: StatusServer, path: str) -> tuple[int, dict, str]:
    async with aiohttp.ClientSession() as session, session.get(server.url + path) as r:
        return r.status, dict(r.headers), await r.text()


async def get_json(server: StatusServer, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.get(server.url + path) as r:
        return r.status, await r.json()


async def test_status_route(status_server):
    code, body = await get_json(status_server, "/api/v1/status")
    assert code == 200
    assert body["peer_id"] == SELF_ID and body["stage"] == 1 and body["state"] == "active"
    assert 300 < body["uptime_s"] < 400
    assert body["microbatches"]["dropped"] == 1
    assert body["bytes_sent"] and body["last_losses"][-1] == 3.812
    assert len(body["history"]["loss"]) == 4  # the ring kept the newest 4 of 6
    assert body["history"]["loss"][-1][1] == pytest.approx(3.5)


async def test_peers_route(status_server):
    code, body = await get_json(status_server, "/api/v1/peers")
    assert code == 200
    assert body["num_stages"] == 3 and body["self"] == SELF_ID
    assert [s["stage"] for s in body["stages"]] == [0, 1, 2]
    peer = body["stages"][1]["peers"][0]
    assert peer["is_self"] and peer["age_s"] >= 4
    assert body["stages"][2]["peers"] == []


async def test_config_and_healthz(status_server):
    assert await get_json(status_server, "/api/v1/config") == (
        200,
        {"stage": "auto", "status_port": 0, "manifest": "tiny"},
    )
    assert await get_json(status_server, "/healthz") == (200, {"ok": True})


@pytest.mark.parametrize("state", ["joining", "warming", "leaving"])
async def test_readyz_is_503_until_active(status_server, daemon: FakeDaemon, state: str):
    assert await get_json(status_server, "/readyz") == (200, {"ready": True, "state": "active"})
    daemon.current["node"]["state"] = state
    assert await get_json(status_server, "/readyz") == (503, {"ready": False, "state": state})


async def test_metrics_route(status_server):
    code, headers, text = await get(status_server, "/metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ("agora_stage 1.0", "agora_inner_step", "agora_microbatches_total", "agora_state"):
        assert name in text


async def test_nan_loss_becomes_null(status_server, daemon: FakeDaemon):
    daemon.current["node"]["val_loss"] = float("nan")
    code, body = await get_json(status_server, "/api/v1/status")
    assert code == 200 and body["val_loss"] is None


async def test_dashboard_is_self_contained(status_server):
    code, headers, html = await get(status_server, "/")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert "api/v1/status" in html and "api/v1/peers" in html
    # Nothing but the serving daemon may be contacted: no absolute URL at all.
    assert "http://" not in html and "https://" not in html and "//cdn" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']//""", html)
    nonce = re.search(r'<script nonce="([^"]+)">', html).group(1)
    assert "{{" not in html and f"'nonce-{nonce}'" in headers["Content-Security-Policy"]


async def test_bound_port_is_reported(status_server):
    assert status_server.port > 0
    assert status_server.url == f"http://127.0.0.1:{status_server.port}"


async def test_port_in_use(status_server, daemon: FakeDaemon):
    second = StatusServer(daemon, Metrics(), port=status_server.port)
    with pytest.raises(PortInUseError, match=rf"status port {status_server.port} is in use"):
        await second.start()
    await second.stop()  # a failed start leaves nothing to clean, stop is still safe


async def test_a_rebound_name_gets_no_status(status_server):
    """A web page whose name was re-pointed at 127.0.0.1 (DNS rebinding) read the node's
    peer id, addresses and config: bound to loopback, only loopback names are answered."""
    url = status_server.url + "/api/v1/status"
    async with aiohttp.ClientSession() as session:
        for host, code in [
            ("evil.example:8421", 403),
            ("127.0.0.1.evil.example", 403),
            (f"localhost:{status_server.port}", 200),
            (f"127.0.0.1:{status_server.port}", 200),
            ("[::1]:8421", 200),
        ]:
            async with session.get(url, headers={"Host": host}) as r:
                assert r.status == code, host


async def test_a_request_whose_headers_never_end_is_closed(daemon: FakeDaemon, monkeypatch):
    """Half-sent requests were held for aiohttp's keep-alive default, 3630 s."""
    import asyncio
    import time

    from agora_node.node import status_server

    monkeypatch.setattr(status_server, "IDLE_CLOSE_S", 0.5)
    server = StatusServer(daemon, Metrics(), port=0)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /api/v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        await writer.drain()
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        assert time.monotonic() - started < 5
        writer.close()
        assert (await get(server, "/healthz"))[0] == 200  # a whole request is answered
    finally:
        await server.stop()


def test_bound_to_all_interfaces_only_addresses_and_its_own_names_are_answered():
    """Bound to 0.0.0.0 (the Docker image's), any name was answered: a page re-pointed at
    a port published on 127.0.0.1, or at the machine on a LAN, read the node's status."""
    from agora_node.node.status_server import answers_to

    names = frozenset({"mybox", "mybox.lan", "mybox.local"})
    for name, answered in [
        ("evil.example", False),
        ("127.0.0.1.evil.example", False),
        ("localhost", True),
        ("127.0.0.1", True),
        ("192.168.1.20", True),
        ("::1", True),
        ("mybox", True),
        ("mybox.local", True),
        ("mybox.evil.example", False),
    ]:
        assert answers_to(name, "0.0.0.0", names) is answered, name
    assert not answers_to("192.168.1.20", "127.0.0.1", names)  # bound to loopback
    assert not answers_to("mybox", "127.0.0.1", names)
    assert answers_to("localhost", "127.0.0.1")


async def test_a_server_on_all_interfaces_answers_the_names_it_is_given(daemon: FakeDaemon):
    server = StatusServer(daemon, Metrics(), host="0.0.0.0", port=0, names=["Prom-Target"])
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/healthz"
        async with aiohttp.ClientSession() as session:
            for host, code in [("evil.example", 403), ("prom-target:9", 200), ("10.1.2.3", 200)]:
                async with session.get(url, headers={"Host": host}) as r:
                    assert r.status == code, host
    finally:
        await server.stop()


async def test_a_server_bound_to_a_name_answers_to_it_and_says_what_it_refused(
    daemon: FakeDaemon, caplog
):
    """Bound to its own name (AGORA_STATUS_HOST=node1.lan), the daemon's own `agora-node
    status` got 403; a refused name was refused in silence."""
    server = StatusServer(daemon, Metrics(), host="localhost", port=0)
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/healthz"
        async with aiohttp.ClientSession() as session:
            for host, code in [("localhost.", 200), ("evil.example", 403)]:
                async with session.get(url, headers={"Host": host}) as r:
                    assert r.status == code, host
    finally:
        await server.stop()
    assert "refused a request naming 'evil.example'" in caplog.text
    assert "only if that name is this machine's own, pass it with --status-names" in caplog.text
    bound = StatusServer(daemon, Metrics(), host="Node1.LAN.", port=0)
    assert "node1.lan" in bound._names
