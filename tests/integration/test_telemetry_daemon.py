"""A real daemon with --mqtt-url publishes its retained status and events to a real broker."""

import signal

import pytest

from tests.broker import receive_sync
from tests.integration.harness import poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.mark.slow  # 20 s; publishing to a real broker is tests/surfaces/test_telemetry.py
def test_daemon_publishes_status_and_leaves_cleanly(swarm, mosquitto):
    swarm.bootstrap("demo")
    node = swarm.join("node", "--stage", "0", "--mqtt-url", mosquitto.url)
    swarm.serving(node)
    mine = poll(lambda: (s := swarm.status(node)) and s["state"] == "active" and s, 90, "active")
    topic = f"agora/{mine['run_id']}/{mine['peer_id']}"

    active = lambda _t, d: d.get("state") == "active"  # noqa: E731
    _, status = receive_sync(mosquitto.port, topic + "/status", active, 30)  # retained
    assert status["peer_id"] == mine["peer_id"] and status["stage"] == 0
    assert status["num_stages"] == 2 and status["telemetry_dropped"] == 0

    left = lambda t, d: t.endswith("/status") and d.get("state") == "left"  # noqa: E731
    seen: list[str] = []

    def leave() -> None:
        swarm.kill(node, signal.SIGTERM)

    def collect(t: str, d: dict) -> bool:
        seen.append(d.get("event") or d.get("state"))
        return left(t, d)

    receive_sync(mosquitto.port, topic + "/#", collect, 90, then=leave)
    assert "leaving" in seen, seen
    assert node.proc.wait(timeout=60) == 0
    assert "telemetry: publishing to 127.0.0.1" in swarm.log(node)


@pytest.mark.slow  # 18 s; a broker that is down costing a bounded queue is tests/surfaces/test_telemetry.py
def test_daemon_with_its_broker_down_serves_and_leaves_as_usual(swarm):
    pytest.importorskip("aiomqtt", reason="aiomqtt is not installed (the mqtt or dev extra)")
    from tests.broker import free_port

    swarm.bootstrap("demo")
    node = swarm.join("node", "--stage", "0", "--mqtt-url", f"mqtt://127.0.0.1:{free_port()}")
    swarm.serving(node)
    poll(lambda: (s := swarm.status(node)) and s["state"] == "active", 90, "active")
    poll(lambda: "telemetry: broker 127.0.0.1" in swarm.log(node), 30, "a telemetry warning")
    swarm.kill(node, signal.SIGTERM)
    assert node.proc.wait(timeout=60) == 0
    assert swarm.log(node).count("telemetry: broker") <= 4  # now and then, not per attempt
