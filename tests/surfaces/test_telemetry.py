"""MQTT telemetry: what is published (pure), and the client against a real mosquitto broker."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from agora_node.node.cli import main
from agora_node.node.telemetry import (
    MAX_PAYLOAD,
    Broker,
    Telemetry,
    backoff_s,
    encode,
    events_between,
    read_login,
    status_payload,
)
from tests.broker import receive
from tests.conftest import BROKER_LOGIN

pytestmark = pytest.mark.timeout(60)

PEER = "12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"
RUN = "0123456789abcdef"
STATUS = f"agora/{RUN}/{PEER}/status"
EVENTS = f"agora/{RUN}/{PEER}/events"


def node(**fields) -> dict:
    base = {"peer_id": PEER, "run_id": RUN, "stage": 0, "num_stages": 2, "state": "active"}
    base |= {"stage_choice": "fixed by --stage", "outer": {"rounds": 0}, "last_losses": [3.0]}
    return base | fields


class FakeNode:
    """What the daemon hands Telemetry: a function returning its snapshot."""

    def __init__(self) -> None:
        self.node = node()

    def snapshot(self) -> dict:
        return {"node": dict(self.node), "history": {"loss": [1.0] * 1000}}


async def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.02)  # polling interval of a deadline-bounded wait


# ---- pure ---------------------------------------------------------------------------------
def test_events_from_snapshot_differences():
    first = events_between(None, node())
    assert [e["event"] for e in first] == ["joined", "stage_chosen"]
    assert first[1] == {"event": "stage_chosen", "stage": 0, "reason": "fixed by --stage"}
    assert events_between(node(), node()) == []

    last = {"round": 7, "delta_group": ["a", "b"], "participants": 3, "bytes_sent": 1000}
    rounds = events_between(node(), node(outer={"rounds": 2, "last_round": last}))
    assert rounds == [
        {
            "event": "outer_round",
            "stage": 0,
            "round": 7,
            "rounds": 2,
            "group": 2,
            "participants": 3,
            "bytes_sent": 1000,
            "bytes_received": None,
            "seconds_blocked": None,
        }
    ]
    moved = events_between(node(), node(stage=1, stage_choice="stage 1 is short", outer={}))
    assert moved == [{"event": "stage_switched", "from": 0, "to": 1, "reason": "stage 1 is short"}]
    assert events_between(node(), node(state="leaving")) == [{"event": "leaving", "stage": 0}]


def test_payloads_are_bounded_json():
    status = status_payload(node(val_loss=math.nan, bytes_sent={"a": 5, "b": 7}))
    data = json.loads(encode(status))
    assert data["val_loss"] is None and data["bytes_sent"] == 12 and data["loss"] == 3.0
    assert "history" not in data and "stages" not in data
    assert len(json.loads(encode({"reason": "x" * 10_000}))["reason"]) == 200
    huge = encode({"event": "e", "items": list(range(5000))})
    assert len(huge) <= MAX_PAYLOAD and json.loads(huge)["truncated"] > MAX_PAYLOAD


def test_backoff_doubles_and_is_capped():
    assert [backoff_s(n, 1.0, 60.0) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff_s(10_000, 1.0, 60.0) == 60.0


def test_broker_url():
    assert Broker.parse("mqtt://127.0.0.1") == Broker("127.0.0.1", 1883, False)
    assert Broker.parse("mqtts://b.example:9000") == Broker("b.example", 9000, True)
    for bad in ["127.0.0.1:1883", "http://h", "mqtt://u:p@h", "mqtt://h/x", "mqtt://h:99999"]:
        with pytest.raises(ValueError):
            Broker.parse(bad)


def test_missing_extra_is_one_line_naming_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "aiomqtt", None)  # as if the extra were not installed
    argv = ["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"]
    argv += ["--data-dir", str(tmp_path / "d"), "--mqtt-url", "mqtt://127.0.0.1:1883"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'agora-node[mqtt]'" in err, err


def test_the_broker_login_file(tmp_path, capsys):
    login = tmp_path / "login"
    login.write_text("agora:pass:word\nignored\n")
    login.chmod(0o600)
    assert read_login(str(login)) == ("agora", "pass:word")
    login.chmod(0o640)  # a password others can read is refused, as ssh refuses such a key
    with pytest.raises(ValueError, match="chmod 600"):
        read_login(str(login))
    for bad in ["no colon\n", ":nobody\n", "x" * 600 + ":p"]:
        login.write_text(bad)
        login.chmod(0o600)
        with pytest.raises(ValueError, match="USER:PASSWORD") as exc:
            read_login(str(login))
        assert "nobody" not in str(exc.value)  # what the file holds is never repeated
    with pytest.raises(ValueError, match="No such file"):
        read_login(str(tmp_path / "missing"))
    pipe = tmp_path / "pipe"  # `--mqtt-login <(pass show mqtt)` read once, then never again
    os.mkfifo(pipe, 0o600)
    with pytest.raises(ValueError, match="not a plain file"):
        read_login(str(pipe))
    argv = ["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"]
    argv += ["--data-dir", str(tmp_path / "d"), "--mqtt-login", str(login)]
    assert main(argv) == 2  # a login with no broker to log in to
    assert "--mqtt-login needs --mqtt-url" in capsys.readouterr().err
    login.chmod(0o644)
    assert main([*argv, "--mqtt-url", "mqtt://127.0.0.1:1883"]) == 2
    assert "readable by others" in capsys.readouterr().err


# ---- against a real broker ------------------------------------------------------------------
async def test_a_broker_with_a_login_hears_only_a_node_that_has_it(mosquitto_login, tmp_path):
    """There was no way to give a broker's login: a broker that refuses anonymous clients
    (any shared one should) could not be used."""
    login = tmp_path / "login"
    login.write_text(":".join(BROKER_LOGIN) + "\n")
    login.chmod(0o600)
    stranger = Telemetry(mosquitto_login.url, FakeNode().snapshot, backoff=(0.05, 0.1))
    telemetry = Telemetry(mosquitto_login.url, FakeNode().snapshot, every_s=0.2, login=str(login))
    try:
        stranger.start()
        await until(lambda: stranger.failures >= 2, 20, "the broker to refuse a node without it")
        assert not stranger.connected and stranger.connects == 0
        active = lambda _t, d: d.get("state") == "active"  # noqa: E731
        port = mosquitto_login.port
        _, status = await receive(
            port, STATUS, active, 20, then=telemetry.start, login=BROKER_LOGIN
        )
        assert status["peer_id"] == PEER and telemetry.connects >= 1
    finally:
        await telemetry.stop()
        await stranger.stop()


async def test_retained_status_and_events_reach_a_fresh_subscriber(mosquitto):
    fake = FakeNode()
    telemetry = Telemetry(mosquitto.url, fake.snapshot, every_s=0.2)
    stopping: list[asyncio.Task] = []

    def leave() -> None:
        fake.node["state"] = "leaving"
        stopping.append(asyncio.ensure_future(telemetry.stop()))

    try:
        chosen = lambda _t, d: d["event"] == "stage_chosen"  # noqa: E731
        _, event = await receive(mosquitto.port, EVENTS, chosen, 20, then=telemetry.start)
        assert event["reason"] == "fixed by --stage"
        active = lambda _t, d: d.get("state") == "active"  # noqa: E731
        _, status = await receive(mosquitto.port, STATUS, active, 20)
        assert status["peer_id"] == PEER and status["stage"] == 0 and status["loss"] == 3.0
        assert status["telemetry_dropped"] == 0

        leaving = lambda _t, d: d["event"] == "leaving"  # noqa: E731
        await receive(mosquitto.port, EVENTS, leaving, 20, then=leave)
        await stopping[0]
        _, left = await receive(mosquitto.port, STATUS, lambda _t, d: True, 20)
        assert left["state"] == "left"  # a clean leave, not the will
    finally:
        await telemetry.stop()


async def test_last_will_when_the_connection_dies(mosquitto):
    script = f"""
import asyncio, sys
from agora_node.node.telemetry import Telemetry
async def main():
    t = Telemetry({mosquitto.url!r}, lambda: {{"node": {node()!r}}}, every_s=0.2)
    t.start()
    while not t.connects:
        await asyncio.sleep(0.02)
    print("connected", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.strip() == "connected"
        await receive(mosquitto.port, STATUS, lambda _t, d: d.get("state") == "active", 20)
        child.send_signal(signal.SIGKILL)  # no DISCONNECT: the broker publishes the will
        _, will = await receive(mosquitto.port, STATUS, lambda _t, d: d["state"] == "gone", 30)
        assert will["peer_id"] == PEER
    finally:
        child.kill()
        child.wait(timeout=10)
        child.stdout.close()


async def test_reconnects_with_backoff_after_the_broker_restarts(mosquitto, caplog):
    fake = FakeNode()
    telemetry = Telemetry(mosquitto.url, fake.snapshot, every_s=0.1, backoff=(0.05, 0.4))
    try:
        telemetry.start()
        await until(lambda: telemetry.connected, 20, "the first connection")
        await asyncio.to_thread(mosquitto.stop)
        await until(lambda: telemetry.failures >= 3, 20, "failed attempts while the broker is down")
        assert not telemetry.connected
        await asyncio.to_thread(mosquitto.start)  # same port; it retains nothing from before
        fake.node["inner_step"] = 42
        _, status = await receive(
            mosquitto.port, STATUS, lambda _t, d: d.get("inner_step") == 42, 20
        )
        assert status["state"] == "active" and telemetry.connects >= 2
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert 1 <= len(warnings) < telemetry.connects + 8  # now and then, not every attempt
    finally:
        await telemetry.stop()


async def test_a_broker_that_is_down_costs_a_bounded_queue(mosquitto):
    mosquitto.stop()
    fake = FakeNode()
    telemetry = Telemetry(mosquitto.url, fake.snapshot, every_s=0.01, backoff=(5, 5), max_queue=4)
    try:
        telemetry.start()
        for stage in range(1, 30):  # more events than fit, while nothing is sent
            fake.node["stage"] = stage % 2
            await asyncio.sleep(0.02)
        assert len(telemetry.queue) <= 4 and telemetry.dropped > 0
        assert sum(m.retain for m in telemetry.queue) <= 1  # one status at most: the latest
    finally:
        began = time.monotonic()
        await telemetry.stop()
        assert time.monotonic() - began < 2


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_broker_that_drops_the_line_after_connack_leaves_no_unread_error(caplog, how):
    """aiomqtt records why a connection ended in a future that, for a drop right after
    CONNACK, nothing reads: asyncio then prints "Future exception was never retrieved" at
    exit. A real socket on loopback plays that broker (mosquitto will not do it on cue),
    closing the line or resetting it; either way the log gets lines spaced 1, 2, 4, 8."""
    caplog.set_level(logging.INFO)
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    lines: list[asyncio.StreamWriter] = []

    async def accept_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        lines.append(writer)
        await reader.read(1)  # the client's CONNECT has begun
        writer.write(bytes([0x20, 2, 0, 0]))  # CONNACK, accepted
        await writer.drain()
        if how == "reset":  # linger 0: the close sends RST
            linger = struct.pack("ii", 1, 0)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        writer.transport.abort()

    server = await asyncio.start_server(accept_then_drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"mqtt://127.0.0.1:{port}"
    telemetry = Telemetry(url, FakeNode().snapshot, backoff=(0.05, 0.1), timeout_s=0.5)
    try:
        try:
            telemetry.start()
            await until(lambda: len(lines) >= 6, 20, "six dropped connections")
        finally:
            await telemetry.stop()
            server.close()
            await server.wait_closed()
        assert telemetry.failures >= 5  # no message acknowledged: the back-off keeps growing
        logged = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert len(logged) <= 4, [r.getMessage() for r in logged]  # 1, 2, 4 (, 8)
        gc.collect()  # a future with an unread exception reports it when it is collected
        await asyncio.sleep(0)  # one turn of the loop, for a report scheduled by the collection
        assert [ctx["message"] for ctx in reported] == []
    finally:
        loop.set_exception_handler(before)


def test_the_client_id_cannot_be_computed_from_public_names():
    """It was sha256 of "agora/<run>/<peer>": anyone reaching the broker could connect with
    it, cutting the node off (its "gone" will fired) as often as they liked."""
    from agora_node.node.telemetry import client_id

    prefix = "agora/run/12D3KooWpeer"
    mine = client_id(prefix, b"secret of this node")
    assert mine == client_id(prefix, b"secret of this node")  # the same after a reconnect
    assert mine != client_id(prefix, b"") and mine != client_id(prefix, b"another secret")
    assert len(mine) <= 23 and mine.isalnum()  # what every MQTT 3.1.1 broker accepts
