"""Context-parallel cells with real daemons on 127.0.0.1: the two replicas of each stage
(the heads too) form a cell by themselves, train the swarm's sequences split between
them (loss falls; the windows pack several documents, which the head, the wire and
every member keep apart), and when the last stage's leader is SIGKILLed its helper trains on
alone from the cell's weights, and the head's micro-batches reach it. (A helper that
dies: tests/node/test_cells.py.)"""

import pytest

from tests.integration.harness import TestSwarm, poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _cell(swarm: TestSwarm, node) -> dict:  # noqa: ANN001
    return (swarm.status(node) or {}).get("cell") or {}


def _ok(swarm: TestSwarm, node) -> int:  # noqa: ANN001
    return ((swarm.status(node) or {}).get("microbatches") or {}).get("ok", 0)


def test_two_replicas_form_a_cell_train_and_survive_the_leader_being_killed(swarm, tmp_path):
    path = small_manifest(
        tmp_path / "cells.toml", stages=2, layers=2, cp_degree=2, kv_rank=8, kv_tokens=True,
        documents=True,  # packed windows: every member keeps their documents apart
    )  # fmt: skip
    swarm.bootstrap(path)
    # --manifest: a head reads the corpus file only a local manifest names
    heads = [swarm.join(f"head-{i}", "--stage", "0", "--manifest", path) for i in range(2)]
    last = [swarm.join(f"last-{i}", "--stage", "1") for i in range(2)]
    for node in (*heads, *last):
        swarm.serving(node)

    def leader_and_helper(pair: list) -> list:
        poll(
            lambda: sorted(_cell(swarm, n).get("role", "") for n in pair) == ["helper", "leader"],
            120,
            "a leader and a helper",
        )
        return sorted(pair, key=lambda n: _cell(swarm, n).get("role") != "leader")

    head, head_helper = leader_and_helper(heads)  # the head's cell injects as one head
    leader, helper = leader_and_helper(last)
    # the cell computes micro-batches: the helper its chunk of each, K/V both ways
    poll(lambda: _cell(swarm, leader).get("microbatches", 0) >= 20, 240, "20 cell micro-batches")
    cell = _cell(swarm, leader)
    # a micro-batch may fail while the two are forming (one already leads, the other does
    # not yet help): it is trained whole, and the cell forms again seconds later
    assert cell["failed"] <= 3, cell
    helped = _cell(swarm, helper)
    assert helped["helped"] >= 10 and helped["kv_bytes_sent"] > 0, helped  # status lags
    # nothing an honest member sends is refused as malformed: what is refused is the
    # formation race above (work or frames from a peer the other does not yet count in
    # its cell: not_leader, not_member) and a frame stored twice after a resent push
    refused = {**cell["refused"], **helped["refused"]}
    assert set(refused) <= {"not_leader", "not_member", "expired"}, refused
    # compressed K/V (rank 8 bf16, a choice byte and a token id byte) per token and layer,
    # each way, plus headers
    assert 0 < cell["kv_bytes_per_token"] < 64, cell
    # the heads' cell splits the sequences it injects the same way
    poll(lambda: _cell(swarm, head).get("microbatches", 0) >= 10, 120, "10 head-cell micro-batches")
    assert _cell(swarm, head_helper)["helped"] >= 5, _cell(swarm, head_helper)
    # what the helping head injected before the cell formed is back by now; from here on it
    # injects nothing of its own (checked at the end)
    injected = _ok(swarm, head_helper)
    losses = poll(lambda: (swarm.status(head) or {}).get("last_losses"), 30, "losses")
    first = losses[0]
    poll(
        lambda: (
            (ls := (swarm.status(head) or {}).get("last_losses")) and sum(ls[-5:]) / 5 < first - 0.5
        ),
        240,
        "the loss falling by 0.5",
    )
    # the leader dies: its micro-batches in flight fail over, the helper goes on alone from
    # the weights it mirrored, and the head's micro-batches reach it
    ok_before = poll(lambda: _ok(swarm, head), 30, "the head's count")
    swarm.kill(leader)
    poll(lambda: _cell(swarm, helper).get("role") == "alone", 120, "the helper alone")
    poll(lambda: _ok(swarm, head) >= ok_before + 20, 180, "20 more micro-batches after the kill")
    assert "no longer helping" in swarm.log(helper)
    assert _ok(swarm, head_helper) <= injected + 2, "a helping head injected micro-batches"
    assert "Traceback" not in swarm.log(helper)
