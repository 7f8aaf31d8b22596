"""Outer steps inside real daemons: replicas of a stage end each round with one anchor."""

import pytest

from tests.integration.harness import poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "overlap, rank",
    [
        (True, 0),  # the built-in manifests' overlapped rounds
        pytest.param(False, 0, marks=pytest.mark.slow),  # rounds that hold inner steps
        pytest.param(True, 2, marks=pytest.mark.slow),  # low-rank factors (tests/outer too)
    ],
)
def test_replicas_of_a_stage_agree_after_outer_rounds(swarm, tmp_path, overlap, rank):
    manifest = small_manifest(
        tmp_path / "two.toml",
        stages=2,
        layers=4,
        inner_steps=3,
        overlap=overlap,
        outer_rank=rank,
    )
    swarm.bootstrap(manifest)
    nodes = [swarm.join(f"node-{i}", "--stage", str(s)) for i, s in enumerate([0, 0, 1, 1])]
    for node in nodes:
        swarm.serving(node)

    def outer(node):
        return (swarm.status(node) or {}).get("outer", {})

    poll(
        lambda: all(outer(n).get("outer_round", 0) >= 2 for n in nodes),
        240,
        "two outer rounds everywhere",
    )

    def mixed_together(a, b) -> list[str]:  # noqa: ANN001
        """Anchor rounds both replicas made after each one's first own round (see below)."""
        da, db = outer(a).get("anchor_digests") or {}, outer(b).get("anchor_digests") or {}
        if not da or not db:  # a replica still loading its state has none yet
            return []
        started = max(min(map(int, da)), min(map(int, db)))  # init (0) or the copied round
        return sorted((r for r in set(da) & set(db) if int(r) > started + 1), key=int)

    for a, b in ((nodes[0], nodes[1]), (nodes[2], nodes[3])):
        # After each round both replicas hold the mixed anchor: same round, same digest.
        # A replica starts from the init (round 0) or from the other's attested anchor
        # (round r, when it joined later). It can miss the round the other had already
        # opened and make the next anchor alone (known since attested state transfer:
        # docs/outer.md "Left open"); from the round after that on they must agree.
        # Digests are kept for the last rounds only, keyed by the round that made them.
        poll(lambda a=a, b=b: mixed_together(a, b), 120, "a round both replicas mixed")
        da, db = outer(a)["anchor_digests"], outer(b)["anchor_digests"]
        common = mixed_together(a, b)
        assert common and all(da[r] == db[r] for r in common), (da, db)
        last = outer(a)["last_round"]
        assert last["consistent"] and len(last["delta_group"]) == 2, last
    # honest load (pipeline, state copies, outer rounds, SWIM) is never refused by a guard
    # (a joiner that asks for state before a replica read its fresh record is refused
    # with no_record and asks again a second later: docs/security.md, "State transfer")
    refused = {n.name: _guard_refusals(swarm.status(n)) for n in nodes}
    assert all(r == {} for r in refused.values()), refused


@pytest.mark.timeout(480)
@pytest.mark.slow  # 40 s; groups are formed in tests/outer (real peers), rounds in the test above
def test_gossip_splits_a_stage_of_four_replicas_into_groups_of_two(swarm, tmp_path):
    """Gossip in daemons: with group_size 2, four replicas of a stage mix their deltas in two
    disjoint pairs that agree on their result, round after round; anchors in int8."""
    manifest = small_manifest(
        tmp_path / "gossip.toml",
        stages=2,
        layers=2,
        inner_steps=2,
        group_size=2,
        anchor_codec="int8",
    )
    swarm.bootstrap(manifest)
    nodes = [swarm.join(f"node-{i}", "--stage", str(s)) for i, s in enumerate([0, 0, 0, 0, 1])]
    for node in nodes:
        swarm.serving(node)
    replicas = nodes[:4]
    ids = {n.name: swarm.status(n)["peer_id"] for n in replicas}

    def rounds(node) -> dict[int, dict]:  # noqa: ANN001
        recent = ((swarm.status(node) or {}).get("outer") or {}).get("recent_rounds") or []
        return {r["round"]: r for r in recent}

    def split_rounds(seen: list[dict[int, dict]]) -> list[int]:
        """Rounds all four replicas mixed with every one of them taking part."""
        common = set.intersection(*(set(s) for s in seen))
        return sorted(r for r in common if all(s[r]["participants"] == 4 for s in seen))

    def anchors_mixed(seen: list[dict[int, dict]]) -> bool:
        """Pairs drawn afresh leave anchors apart (not at round 0, from one init, nor when
        a round's anchor pairs repeat the last delta pairs): int8 mixes repair them."""
        return any(s[r]["anchor_mixed"] for s in seen for r in split_rounds(seen))

    def enough(seen: list[dict[int, dict]]) -> bool:
        return len(split_rounds(seen)) >= 2 and anchors_mixed(seen)

    def look() -> dict[str, dict[int, dict]] | None:
        seen = {n.name: rounds(n) for n in replicas}
        return seen if enough(list(seen.values())) else None

    seen = poll(look, 280, "two rounds with all four replicas, anchors mixed in one")
    split = split_rounds(list(seen.values()))  # of that one look: later rounds are not in it
    for r in split:
        groups = {name: frozenset(s[r]["group"]) for name, s in seen.items()}
        for name, group in groups.items():
            assert ids[name] in group and len(group) == 2, (r, groups)
            partner = next(n for n, pid in ids.items() if pid in group and n != name)
            assert groups[partner] == group, (r, groups)  # both name the same pair
            assert seen[name][r]["consistent"], (r, seen[name][r])
            assert not seen[name][r]["failed_peers"], (r, seen[name][r])
        assert len(set(groups.values())) == 2, (r, groups)  # two groups, not one of four
    refused = {n.name: _guard_refusals(swarm.status(n)) for n in nodes}
    assert all(r == {} for r in refused.values()), refused


def _guard_refusals(status: dict | None) -> dict:
    """`requests_refused` less the state requests of joiners not read yet (`no_record`)."""
    out = {}
    for protocol, reasons in ((status or {}).get("requests_refused") or {}).items():
        kept = {r: n for r, n in reasons.items() if (protocol, r) != ("state", "no_record")}
        if kept:
            out[protocol] = kept
    return out


def test_a_replica_announces_each_round_without_waiting_for_its_refresh(swarm, tmp_path):
    # A joiner adopts a replica's state only once the records attest it, and a record that
    # lagged the anchor by a refresh made stages with short rounds hard to join. With a
    # refresh of 120 s, the node's own record, read back from the DHT, follows its rounds.
    manifest = small_manifest(tmp_path / "one.toml", stages=1, layers=2, inner_steps=3)
    swarm.bootstrap(manifest)
    node = swarm.join("node", "--stage", "0", "--refresh", "120", "--record-ttl", "300")
    swarm.serving(node)

    def own_record_round() -> int:
        return next((p["outer_step"] for p in swarm.peers(node) or [] if p["is_self"]), 0)

    poll(lambda: own_record_round() >= 3, 90, "its record, read back, at outer round 3")
