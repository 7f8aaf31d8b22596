"""A training swarm's operator surfaces: every node's /metrics counters move, parsed as
Prometheus parses them, and the dashboard, rendered in headless Chromium, shows the
swarm. The tests share one swarm (two stages, two replicas each)."""

import os
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agora_node.node.demo import Child
from tests.chromium import dump_dom, need_chromium, screenshot
from tests.integration.harness import TestSwarm, poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@dataclass
class Training:
    swarm: TestSwarm
    nodes: list[Child]
    ports: list[int]


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("training-swarm")
    swarm = TestSwarm(workdir)
    try:
        swarm.bootstrap(small_manifest(workdir / "two.toml", stages=2, layers=2, inner_steps=3))
        nodes = [swarm.join(f"node-{i}", "--stage", str(s)) for i, s in enumerate([0, 0, 1, 1])]
        yield Training(swarm, nodes, [swarm.serving(node) for node in nodes])
    finally:
        swarm.stop(grace_s=10)  # SIGTERM, then SIGKILL of every process group, by pid


def scrape(port: int) -> dict[tuple[str, tuple], float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def moved(m: dict | None) -> bool:
    """Micro-batches served and timed, bytes both ways, an outer round, SWIM traffic."""
    return bool(m) and all(
        m.get(key, 0) > 0
        for key in (
            ("agora_microbatches_total", (("result", "ok"),)),
            ("agora_microbatch_latency_seconds_count", ()),
            ("agora_bytes_sent_total", ()),
            ("agora_bytes_received_total", ()),
            ("agora_outer_rounds_total", ()),
            ("agora_membership_messages_total", (("direction", "sent"),)),
            ("agora_compute_rate_tokens_per_s", ()),
        )
    )


def test_every_nodes_metrics_move_in_a_training_swarm(training):
    swarm, nodes, ports = training.swarm, training.nodes, training.ports
    scrapes = poll(
        lambda: (s := [scrape(p) for p in ports]) and all(moved(m) for m in s) and s,
        240,
        "micro-batch, latency, byte, outer and SWIM counters moving on every node",
    )
    for node, m in zip(nodes, scrapes, strict=True):
        ok = m[("agora_microbatches_total", (("result", "ok"),))]
        # Every completed micro-batch was timed once, and the JSON counts the same events.
        assert m[("agora_microbatch_latency_seconds_count", ())] == ok
        poll(
            lambda: (swarm.status(node) or {}).get("microbatches", {}).get("ok", 0) >= ok,  # noqa: B023
            10,
            "the status JSON to show the same micro-batches",
        )
    heads = scrapes[:2]
    assert all(m[("agora_completed_tokens_total", ())] > 0 for m in heads)
    assert all(m[("agora_completed_tokens_per_s", ())] > 0 for m in heads)


def test_dashboard_shows_the_swarm_in_chromium(training, tmp_path):
    """Last in this module: it stops one node so that the page has a departure to show."""
    browser = need_chromium()
    swarm, node, port = training.swarm, training.nodes[0], training.ports[0]

    def events(status: dict) -> list[dict]:
        return (status.get("members") or {}).get("events") or []

    def mixed(status: dict) -> bool:
        rounds = (status.get("outer") or {}).get("recent_rounds") or []
        return any(len(r["group"]) >= 2 for r in rounds)

    poll(lambda: mixed(swarm.status(node) or {}), 120, "an outer round with a partner")

    def measured(peers: list[dict]) -> bool:  # SWIM's probes timed every other node
        return all(p["rtt_ms"] is not None for p in peers if not p["is_self"])

    peers = poll(
        lambda: (p := swarm.peers(node)) and len(p) == 4 and measured(p) and p,
        30,
        "all 4 peers, each with a round trip",
    )
    assert all(0 <= p["rtt_ms"] < 1000 for p in peers if not p["is_self"]), peers
    leaver = swarm.status(training.nodes[3])["peer_id"]
    swarm.kill(training.nodes[3], signal.SIGTERM)
    status = poll(
        lambda: (
            (s := swarm.status(node))
            and any(e["event"] == "left" and e["peer_id"] == leaver for e in events(s))
            and s
        ),
        60,
        "node-3's departure among node-0's membership events",
    )
    url = f"http://127.0.0.1:{port}/"
    dom = dump_dom(browser, url, tmp_path)

    assert 'data-stage="0"' in dom and 'data-stage="1"' in dom
    stayed = [p["peer_id"] for p in peers if p["peer_id"] != leaver]
    assert len(stayed) == 3 and all(f'data-peer="{p}"' in dom for p in stayed)
    assert status["peer_id"] in dom and "(this node)" in dom
    assert "data-round=" in dom and "2 of " in dom  # a completed round with a partner
    assert 'class="ev-joined"' in dom and 'class="ev-left"' in dom
    assert "fixed by --stage" in dom  # why this node serves its stage
    assert "tok per compute-s" in dom and "no peer in the directory yet" not in dom
    assert "rtt " in dom and " ms</" in dom  # the round trips, as tags
    # CI keeps the screenshot as an artifact: .ci/run points AGORA_TEST_ARTIFACTS at a folder
    folder = Path(os.environ.get("AGORA_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    png = screenshot(browser, url, folder / "dashboard.png")
    assert png.stat().st_size > 10_000, png  # a rendered page, not an empty image
    print(f"dashboard screenshot: {png}")
