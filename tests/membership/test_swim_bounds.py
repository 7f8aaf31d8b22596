"""Membership state stays bounded whatever strangers send (identities are free).

Real Ed25519 identities and the daemon's verifier, one machine, no network."""

from __future__ import annotations

import pytest
from swim_helpers import FAST, item, lone_machine, message

from agora_node.comms.membership import messages as wire
from agora_node.comms.membership.messages import MemberMeta, MsgKind, Status
from agora_node.comms.membership.replay import ReplayGuard
from agora_node.protocol.identity import Identity

pytestmark = pytest.mark.timeout(30)


def _alive(identity: Identity) -> bytes:
    return item(identity, Status.ALIVE, identity.peer_id, 0, meta=MemberMeta(stage=0))


def _gossip(sender: Identity, to: str, seq: int, items: list[bytes]) -> bytes:
    return message(sender, to, MsgKind.GOSSIP, seq, items=items)


def test_the_member_table_is_bounded_and_keeps_live_members() -> None:
    me, relay = Identity.generate(), Identity.generate()
    machine, _ = lone_machine(me, settings=FAST.with_overrides(max_members=4))
    strangers = [Identity.generate() for _ in range(10)]
    # one honest relay, then ten fresh identities gossiped by it, 5 per message
    machine.on_message(relay.peer_id, _gossip(relay, me.peer_id, 1, [_alive(relay)]), 0.1)
    for seq, start in enumerate(range(0, 10, 5), 2):
        batch = [_alive(s) for s in strangers[start : start + 5]]
        machine.on_message(relay.peer_id, _gossip(relay, me.peer_id, seq, batch), 0.2)
    assert len(machine.members()) == 4
    assert machine.get(relay.peer_id) is not None  # the ones already known stay
    assert machine.counters["dropped_table_full"] == 7


def test_a_full_table_makes_room_by_forgetting_the_gone_first() -> None:
    me, relay = Identity.generate(), Identity.generate()
    machine, _ = lone_machine(me, settings=FAST.with_overrides(max_members=2))
    leaver, newcomer = Identity.generate(), Identity.generate()
    left = item(leaver, Status.LEFT, leaver.peer_id, 1)
    machine.on_message(
        relay.peer_id, _gossip(relay, me.peer_id, 1, [_alive(relay), _alive(leaver)]), 0.1
    )
    machine.on_message(relay.peer_id, _gossip(relay, me.peer_id, 2, [left]), 0.2)
    machine.on_message(relay.peer_id, _gossip(relay, me.peer_id, 3, [_alive(newcomer)]), 0.3)
    ids = {m.peer_id for m in machine.members()}
    assert ids == {relay.peer_id, newcomer.peer_id}
    assert machine.counters["dropped_table_full"] == 0


def test_ping_reqs_carried_for_others_are_bounded() -> None:
    me, asker = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me, settings=FAST.with_overrides(max_relays=3))
    targets = [Identity.generate().peer_id for _ in range(5)]
    for seq, target in enumerate(targets, 1):
        body = wire.ping_req_body(seq, target, 65535)  # the longest nack delay allowed
        machine.on_message(
            asker.peer_id, message(asker, me.peer_id, MsgKind.PING_REQ, seq, body), 0.1
        )
    pinged = {to for to, data in out.sent if wire.decode_envelope(data).kind == MsgKind.PING}
    assert pinged == set(targets[:3])
    assert machine.counters["dropped_relays_full"] == 2


def test_replay_windows_are_kept_for_a_bounded_number_of_senders() -> None:
    guard = ReplayGuard(max_senders=3)
    for n in range(10):
        assert guard.accept(f"peer-{n}", 1)
    assert guard.accept("peer-9", 2) and not guard.accept("peer-9", 2)  # recent: remembered
    assert len(guard._seen) == 3
    assert guard.accept("peer-0", 1)  # forgotten long ago: its window starts again
