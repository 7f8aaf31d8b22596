"""Outer steps inside real daemons: replicas of a stage end each round with one anchor."""

import pytest

from tests.integration.harness import poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_replicas_of_a_stage_agree_after_outer_rounds(swarm, tmp_path):
    manifest = small_manifest(tmp_path / "two.toml", stages=2, layers=4, inner_steps=3)
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
    refused = {n.name: (swarm.status(n) or {}).get("requests_refused") for n in nodes}
    assert all(r == {} for r in refused.values()), refused
