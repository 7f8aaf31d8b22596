"""joining.check_identity_unused: a daemon elsewhere with this node's key is found before
this one announces itself; a dead predecessor's record is not mistaken for one."""

from __future__ import annotations

import time

import pytest

from agora_node.node.errors import JoinError
from agora_node.node.joining import check_identity_unused
from agora_node.protocol.records import NodeRecord

pytestmark = pytest.mark.timeout(30)

ME, OTHER = "12D3KooWme", "12D3KooWother"


class Directory:
    """Reads the records a script gives, one list per fetch (the last one repeats)."""

    def __init__(self, *reads: list[NodeRecord]) -> None:
        self.reads, self.fetches = list(reads), 0

    async def fetch(self) -> dict[int, list[NodeRecord]]:
        self.fetches += 1
        records = self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]
        return {0: [r for r in records if r.stage == 0], 1: [r for r in records if r.stage == 1]}


def record(peer: str, issued_at: float, stage: int = 1) -> NodeRecord:
    return NodeRecord(
        run_id="r", peer_id=peer, stage=stage, issued_at=issued_at, addrs=["/ip4/10.0.0.7/tcp/1"]
    )


async def test_nothing_to_wait_for_without_a_fresh_record_of_ours() -> None:
    now = time.time()
    for records in ([], [record(OTHER, now)], [record(ME, now - 60)]):  # none; others; dead
        directory = Directory(records)
        await check_identity_unused(directory, ME, since=now - 1, refresh_s=3.0)
        assert directory.fetches == 1


async def test_a_record_of_ours_issued_again_after_we_started_is_another_daemon() -> None:
    started = time.time()
    directory = Directory(
        [record(ME, started - 1)],  # could be our predecessor's last one...
        [record(ME, started + 0.1)],  # ...but somebody signs new ones
        [record(ME, started + 0.2, stage=0)],
    )
    with pytest.raises(JoinError, match="another daemon serves stage 0 with this identity key"):
        await check_identity_unused(directory, ME, since=started, refresh_s=0.05)
    assert directory.fetches == 3


async def test_a_fresh_record_never_issued_again_is_a_predecessor_and_waits_bounded() -> None:
    started = time.time()
    directory = Directory([record(ME, started - 1)])  # died a second before we started
    t0 = time.monotonic()
    await check_identity_unused(directory, ME, since=started, refresh_s=0.1)
    assert time.monotonic() - t0 < 2.25 + 1.0  # 2.5 refresh intervals + 2 s, and slack
    # one record issued after our start (a skewed clock) is not yet evidence either
    directory = Directory([record(ME, started + 0.5)])
    await check_identity_unused(directory, ME, since=started, refresh_s=0.1)


async def test_an_empty_read_after_a_fresh_record_is_no_answer() -> None:
    """A DHT read that timed out, or the other daemon between stages, reads empty: the check
    goes on instead of letting the twin through (found by a review)."""
    started = time.time()
    directory = Directory(
        [record(ME, started + 0.1)],
        [],
        [record(ME, started + 0.2)],  # fresh, empty, again
    )
    with pytest.raises(JoinError, match="stop that daemon first"):
        await check_identity_unused(directory, ME, since=started, refresh_s=0.05)
