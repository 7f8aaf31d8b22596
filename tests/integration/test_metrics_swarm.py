"""/metrics of a training swarm: every node's counters move, parsed as Prometheus parses them."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


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


def test_every_nodes_metrics_move_in_a_training_swarm(swarm, tmp_path):
    manifest = small_manifest(tmp_path / "two.toml", stages=2, layers=2, inner_steps=3)
    swarm.bootstrap(manifest)
    nodes = [swarm.join(f"node-{i}", "--stage", str(s)) for i, s in enumerate([0, 0, 1, 1])]
    ports = [swarm.serving(node) for node in nodes]
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
