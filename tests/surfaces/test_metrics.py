"""Metrics: private registries, agora_ names, bounded labels, levels from the snapshot."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agora_node.node.metrics import MAX_PEERS, MAX_REASONS, OTHER, Metrics

from .conftest import OTHER_ID, make_snapshot

pytestmark = pytest.mark.timeout(60)


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_two_instances_do_not_share_a_registry():
    a, b = Metrics(), Metrics()  # the global registry would raise "Duplicated timeseries"
    a.count_rejected_record("bad_signature")
    assert samples(a)[("agora_records_rejected_total", (("reason", "bad_signature"),))] == 1
    assert ("agora_records_rejected_total", (("reason", "bad_signature"),)) not in samples(b)


def test_every_metric_is_prefixed():
    m = Metrics()
    m.update_from_snapshot(make_snapshot())
    names = {name for name, _ in samples(m)}
    assert names and all(name.startswith("agora_") for name in names)


def test_events_are_counted():
    m = Metrics()
    m.count_microbatch("ok", latency_s=0.2)
    m.count_microbatch("dropped")
    m.add_bytes(OTHER_ID, sent=100, received=50)
    m.add_bytes(OTHER_ID, sent=1)
    s = samples(m)
    assert s[("agora_microbatches_total", (("result", "ok"),))] == 1
    assert s[("agora_microbatches_total", (("result", "rejected"),))] == 0
    assert s[("agora_microbatch_latency_seconds_count", ())] == 1
    assert s[("agora_bytes_sent_total", ())] == 101
    assert m.microbatch_counts() == {"ok": 1, "dropped": 1, "rejected": 0}
    assert m.bytes_by_peer() == ({OTHER_ID: 101}, {OTHER_ID: 50})


def test_unknown_microbatch_result_is_refused():
    with pytest.raises(ValueError, match="result"):
        Metrics().count_microbatch("weird")


def test_label_values_stay_bounded():
    m = Metrics()
    for i in range(MAX_REASONS + 5):
        m.count_rejected_record(f"reason-{i}")
    for i in range(MAX_PEERS + 5):
        m.add_bytes(f"peer-{i}", sent=1)
    reasons = {dict(k[1])["reason"] for k in samples(m) if k[0] == "agora_records_rejected_total"}
    assert len(reasons) == MAX_REASONS + 1 and OTHER in reasons
    sent, _ = m.bytes_by_peer()
    assert len(sent) == MAX_PEERS + 1 and sent[OTHER] == 5


def test_levels_come_from_the_snapshot():
    m = Metrics()
    m.update_from_snapshot(make_snapshot(state="warming"))
    s = samples(m)
    assert s[("agora_stage", ())] == 1
    assert s[("agora_state", (("agora_state", "warming"),))] == 1
    assert s[("agora_state", (("agora_state", "active"),))] == 0
    assert s[("agora_loss", ())] == pytest.approx(3.812)
    assert s[("agora_peers_alive", (("stage", "1"),))] == 1  # the leaving peer does not count
    assert s[("agora_peers_alive", (("stage", "2"),))] == 0
    # a peer membership declared dead counts no more, though its record lives on a while
    snapshot = make_snapshot()
    snapshot["stages"][0]["peers"][0]["swim"] = "dead"
    m.update_from_snapshot(snapshot)
    assert samples(m)[("agora_peers_alive", (("stage", "0"),))] == 0
    info = next(labels for name, labels in s if name == "agora_node_info")
    assert ("device", "cuda:1") in info and ("precision", "bf16") in info


def test_rejections_keep_their_code():
    m = Metrics()
    m.count_microbatch("rejected", code="bad_shape")
    m.count_microbatch("rejected", code="bad_shape")
    assert m.rejected_codes() == {"bad_shape": 2}
    assert samples(m)[("agora_microbatches_rejected_total", (("code", "bad_shape"),))] == 2


def test_outer_and_membership_counters_come_from_the_snapshot():
    m = Metrics()
    snap = make_snapshot()
    snap["node"]["outer"] = {
        "rounds": 3,
        "bytes_sent": 700,
        "bytes_received": 650,
        "seconds_blocked": 1.5,
    }
    snap["node"]["members"] = {
        "counters": {"sent": 9, "sent_bytes": 900, "received": 8, "probes": 4}
    }
    m.update_from_snapshot(snap)
    s = samples(m)
    assert s[("agora_outer_rounds_total", ())] == 3
    assert s[("agora_outer_bytes_sent_total", ())] == 700
    assert s[("agora_outer_blocked_seconds_total", ())] == 1.5
    assert s[("agora_membership_messages_total", (("direction", "sent"),))] == 9
    assert s[("agora_membership_bytes_total", (("direction", "sent"),))] == 900
    assert s[("agora_membership_events_total", (("event", "probes"),))] == 4


def test_counters_kept_by_a_stage_s_objects_continue_across_a_stage_switch():
    """A switch builds a new outer loop and worker, whose counts start at 0 again: the
    exported counters went down with them, which Prometheus reads as a restart."""
    m = Metrics()
    counts = [(3, 5), (0, 0), (1, 2)]  # before the switch, while loading, after it
    for rounds, recomputed in counts:
        snap = make_snapshot()
        snap["node"]["outer"] = {"rounds": rounds, "bytes_sent": 100 * rounds}
        snap["node"]["memory"] = {"recomputed": recomputed}
        m.update_from_snapshot(snap)
    s = samples(m)
    assert s[("agora_outer_rounds_total", ())] == 4
    assert s[("agora_outer_bytes_sent_total", ())] == 400
    assert s[("agora_recomputed_microbatches_total", ())] == 7


def test_compute_rate_utilization_and_gradient_lag_are_levels():
    m = Metrics()
    snap = make_snapshot()
    snap["node"]["utilization"] = 0.25
    m.update_from_snapshot(snap)
    s = samples(m)
    assert s[("agora_compute_rate_tokens_per_s", ())] == 1234.5  # the record's throughput
    assert s[("agora_utilization_ratio", ())] == 0.25
    assert s[("agora_gradient_lag_steps", ())] == 0.42
    assert s[("agora_relayed_peers", ())] == 1 and s[("agora_relayed_addrs", ())] == 1
    assert s[("agora_cell_members", ())] == 2 and s[("agora_cell_kv_bytes_sent_total", ())] == 1968
    assert s[("agora_cell_exchange_wait_seconds_total", ())] == 3.5
    assert s[("agora_cell_failed_microbatches_total", ())] == 1  # totals are counters


def test_refused_requests_are_counted_by_protocol_and_reason():
    m = Metrics()
    m.count_refused("forward", "rate")
    m.count_refused("forward", "rate")
    m.count_refused("state", "read_deadline")
    key = ("agora_requests_refused_total", (("protocol", "forward"), ("reason", "rate")))
    assert samples(m)[key] == 2
    assert m.refused_counts() == {"forward": {"rate": 2}, "state": {"read_deadline": 1}}


def test_flagged_peers_and_bans_come_from_the_snapshot():
    from agora_node.node.suspects import Reason, Suspects

    suspects = Suspects(me="me")
    suspects.flag("bad", Reason.NORM_OUTLIER, "outer round 3")
    suspects.flag("bad", Reason.NORM_OUTLIER, "outer round 4")
    suspects.flag("worse", Reason.NONFINITE, "loss nan")
    snap = make_snapshot()
    snap["node"]["suspects"] = suspects.status()
    m = Metrics()
    m.update_from_snapshot(snap)
    s = samples(m)
    assert s[("agora_peers_flagged_total", (("reason", "norm_outlier"),))] == 2
    assert s[("agora_peers_flagged_total", (("reason", "nonfinite"),))] == 1
    assert s[("agora_peers_flagged_total", (("reason", "mismatch"),))] == 0
    assert s[("agora_peers_banned", ())] == 2
    empty = Metrics()
    empty.update_from_snapshot(make_snapshot())  # a snapshot without the field: zeros
    assert samples(empty)[("agora_peers_banned", ())] == 0
