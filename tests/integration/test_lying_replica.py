"""A replica of the last stage that lies on what it returns is caught by real daemons.

A head, two honest replicas of the last stage and one that negates every gradient it
returns (its norm unchanged), reports a loss of 0.01 or returns noise of a plausible
spread as gradients (tests/integration/lying_replica.py).
Before canaries of the last stage were training micro-batches, neither was ever caught: a
QA run's head trained on the negated gradients (its validation loss rose 2.85 -> 3.23)
with nobody flagged. Now the head flags the liar (a check every 64 micro-batches its
replicas answer) and bans it, and no honest replica.
"""

import pytest

from tests.integration.harness import poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.slow  # 60-90 s each; the default suite has the check itself, with a fake
# network, in tests/node/test_canary.py (the same lies and an honest run)
@pytest.mark.parametrize("lie", ["gradient", "loss", "noise"])
def test_a_lying_replica_of_the_last_stage_is_banned_and_no_honest_one(swarm, tmp_path, lie):
    manifest = small_manifest(tmp_path / "two.toml", stages=2, layers=2)
    swarm.bootstrap(manifest)
    head = swarm.join("head", "--stage", "0")
    honest = [swarm.join(f"honest-{i}", "--stage", "1") for i in range(2)]
    liar = swarm.join(
        "liar", "--stage", "1", module="tests.integration.lying_replica", env={"AGORA_LIE": lie}
    )
    for node in [head, *honest, liar]:
        swarm.serving(node, timeout=180)
    liar_id = (swarm.status(liar) or {}).get("peer_id")
    honest_ids = {(swarm.status(n) or {}).get("peer_id") for n in honest}
    assert liar_id and all(honest_ids)

    def banned() -> dict[str, str]:
        suspects = (swarm.status(head) or {}).get("suspects") or {}
        return {b["peer"]: b.get("evidence", "") for b in suspects.get("banned", [])}

    found = poll(lambda: banned().get(liar_id), 180, "the head to ban the liar")
    assert lie in found  # the evidence names it: "its gradient", "its loss", "were noise"
    assert not set(banned()) & honest_ids
    canaries = (swarm.status(head) or {}).get("canaries") or {}
    assert canaries.get("trained", 0) >= 2 and canaries.get("flagged", 0) >= 1
