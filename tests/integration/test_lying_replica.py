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


@pytest.mark.timeout(720)
@pytest.mark.slow  # 2-4 minutes; the default suite has the check with a fake network
# (tests/node/test_canary.py, a head sending noise as activations)
def test_a_head_sending_noise_as_activations_is_refused_by_the_next_stage(swarm, tmp_path):
    """Nobody could recompute a head's activations but other heads, and nobody asked: a
    head sending noise of a plausible spread poisoned the next stage's training. Now the
    replicas of stage 1 have other heads recompute one micro-batch in 64 and refuse the
    liar's from then on; no honest head is banned."""
    manifest = small_manifest(tmp_path / "two.toml", stages=2, layers=2)
    swarm.bootstrap(manifest)
    heads = [swarm.join(f"head-{i}", "--stage", "0") for i in range(2)]
    liar = swarm.join(
        "liar", "--stage", "0", module="tests.integration.lying_replica",
        env={"AGORA_LIE": "activations"},
    )  # fmt: skip
    replicas = [swarm.join(f"replica-{i}", "--stage", "1") for i in range(2)]
    for node in [*heads, liar, *replicas]:
        swarm.serving(node, timeout=180)
    liar_id = (swarm.status(liar) or {}).get("peer_id")
    honest_ids = {(swarm.status(n) or {}).get("peer_id") for n in heads}
    assert liar_id and all(honest_ids)

    def canary_bans(node) -> dict[str, str]:  # noqa: ANN001
        suspects = (swarm.status(node) or {}).get("suspects") or {}
        return {
            b["peer"]: b["evidence"] for b in suspects.get("banned", []) if b["reason"] == "canary"
        }

    found = poll(
        lambda: canary_bans(replicas[0]).get(liar_id) or canary_bans(replicas[1]).get(liar_id),
        480,  # two checks of the liar in a row: 1.7 min in one run, over 4 in another
        "a replica of stage 1 to ban the lying head",
    )
    assert "heads recomputed" in found
    for node in replicas:
        assert not set(canary_bans(node)) & honest_ids
