"""What one stranger's signed messages can no longer do to a member (an adversarial
review's findings): push an incarnation off the wire, get a live member declared dead
with a few fresh keys, turn one message into hundreds of replies, or hold the relay
table. Real Ed25519 identities and the daemon's verifier, one machine, no network."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from swim_helpers import FAST, item, lone_machine, message

from agora_node.comms.membership import messages as wire
from agora_node.comms.membership.members import precedence
from agora_node.comms.membership.messages import MemberMeta, MsgKind, Status
from agora_node.comms.membership.p2p import MAX_IN_FLIGHT_TO_ONE, MembershipService
from agora_node.comms.membership.swim import MAX_RELAYS_PER_ORIGIN, MAX_REPLY_ITEMS
from agora_node.protocol.identity import Identity

pytestmark = pytest.mark.timeout(60)
TOP = 2**32 - 1


def _alive(identity: Identity, inc: int = 0) -> bytes:
    return item(identity, Status.ALIVE, identity.peer_id, inc, meta=MemberMeta(stage=0))


def _gossip(sender: Identity, to: str, seq: int, items: list[bytes]) -> bytes:
    return message(sender, to, MsgKind.GOSSIP, seq, items=items)


def test_an_accusation_above_the_own_incarnation_is_ignored() -> None:
    """A SUSPECT at 2**32 - 1 made the member refute to 2**32, which no u32 holds: every
    message it sent after raised, and so did its stage switch and its leave."""
    me, stranger = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me, incarnation_start=1000)
    forged = item(stranger, Status.SUSPECT, me.peer_id, TOP)
    machine.on_message(stranger.peer_id, _gossip(stranger, me.peer_id, 1, [forged]), 0.1)
    assert machine.incarnation == 1000 and machine.counters["dropped_future_accusations"] == 1
    honest = item(stranger, Status.SUSPECT, me.peer_id, 1000)  # at what it knows: refuted
    machine.on_message(stranger.peer_id, _gossip(stranger, me.peer_id, 2, [honest]), 0.2)
    assert machine.incarnation == 1001
    machine.update_meta(MemberMeta(stage=1), 0.3)  # sends and signs as before


def test_a_chain_of_accusations_in_one_message_is_refuted_once() -> None:
    """Accusations at i, i+1, ..., i+254 in one message (fresh accusers): each was "at our
    incarnation" once the one before it was refuted, so one 45 KB message raised the
    incarnation by 255, the local-health score to its top and sent 510 messages to 256
    hostless peer ids. Now: one refutation a message, its record to the accuser and the
    sender only."""
    me, stranger = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me, incarnation_start=1000)
    chain = [item(Identity.generate(), Status.SUSPECT, me.peer_id, 1000 + k) for k in range(40)]
    before = len(out.sent)
    machine.on_message(stranger.peer_id, _gossip(stranger, me.peer_id, 1, chain), 0.1)
    assert machine.incarnation == 1001 and machine.counters["refutations"] == 1
    assert machine.awareness.score == 1
    assert len(out.sent) - before <= 2  # the first item's accuser and the sender
    again = item(Identity.generate(), Status.SUSPECT, me.peer_id, 1001)  # the next message
    machine.on_message(stranger.peer_id, _gossip(stranger, me.peer_id, 2, [again]), 0.2)
    assert machine.incarnation == 1002  # a new message at the new incarnation: refuted


def test_an_accusation_above_a_member_s_known_incarnation_is_not_taken() -> None:
    me, alice, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    machine, _ = lone_machine(me)
    machine.learn([_alive(alice, 5)], 0.0)
    member = machine._members.get(alice.peer_id)
    ahead = wire.decode_item(item(stranger, Status.SUSPECT, alice.peer_id, TOP))
    assert precedence(member, ahead) is None
    at = wire.decode_item(item(stranger, Status.SUSPECT, alice.peer_id, 5))
    assert precedence(member, at) == "apply"
    left = wire.decode_item(item(alice, Status.LEFT, alice.peer_id, 9))  # its own word
    assert precedence(member, left) == "apply"


def test_fresh_keys_cannot_get_a_live_member_declared_dead() -> None:
    """Four fresh keys' SUSPECTs in one message made it DEAD a second later, with no probe
    of our own: routing, rounds and cells dropped it."""
    me, alice = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me)
    machine.learn([_alive(alice)], 0.0)
    keys = [Identity.generate() for _ in range(4)]
    accusations = [item(k, Status.SUSPECT, alice.peer_id, 0) for k in keys]
    alives = [_alive(k) for k in keys]  # members in one message: still unprobed
    machine.on_message(keys[0].peer_id, _gossip(keys[0], me.peer_id, 1, alives), 0.1)
    machine.on_message(keys[0].peer_id, _gossip(keys[0], me.peer_id, 2, accusations), 0.2)
    assert machine.counters["dropped_unknown_confirmers"] == 3
    answered: set[int] = set()
    t = 0.2
    while t < 0.2 + 2 * FAST.suspicion_bounds(machine.cluster_size())[1]:
        t += 0.05
        machine.tick(t)
        for to, data in list(out.sent):  # alice is alive: she answers every ping
            env = wire.decode_envelope(data)
            if to == alice.peer_id and env.kind == MsgKind.PING and id(data) not in answered:
                answered.add(id(data))
                ack = message(alice, me.peer_id, MsgKind.ACK, 10 + len(answered),
                              wire.probe_body(env.probe_seq))  # fmt: skip
                machine.on_message(alice.peer_id, ack, t)
        assert machine.get(alice.peer_id).status != Status.DEAD, t
    # (still suspected: a real alice refutes the suspicion sent to her, this one only acks)


def test_one_message_of_stale_news_earns_one_bounded_reply() -> None:
    """Each stale accusation about us (or about others) was answered by a signed message
    of its own: 255 in one message meant 255 sends."""
    me, stranger = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me, incarnation_start=50)
    stale = [item(Identity.generate(), Status.SUSPECT, me.peer_id, inc) for inc in range(40)]
    machine.on_message(stranger.peer_id, _gossip(stranger, me.peer_id, 1, stale), 0.1)
    replies = [d for to, d in out.sent if to == stranger.peer_id]
    assert len(replies) == 1
    assert len(wire.decode_envelope(replies[0]).items) <= MAX_REPLY_ITEMS + 8  # + piggyback


def test_push_pulls_are_answered_once_per_window_per_peer() -> None:
    me, stranger = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me)
    body = wire.push_pull_body(False, [])
    for seq in range(1, 6):
        pp = message(stranger, me.peer_id, MsgKind.PUSH_PULL, seq, body)
        machine.on_message(stranger.peer_id, pp, 0.1 * seq)
    assert out.kinds_to(stranger.peer_id).count(MsgKind.PUSH_PULL) == 1
    assert machine.counters["dropped_push_pulls"] == 4


def test_one_origin_holds_few_relay_slots_and_only_briefly() -> None:
    me, asker = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me)
    for seq in range(1, 2 * MAX_RELAYS_PER_ORIGIN + 1):
        body = wire.ping_req_body(seq, Identity.generate().peer_id, 65535)
        machine.on_message(
            asker.peer_id, message(asker, me.peer_id, MsgKind.PING_REQ, seq, body), 0.1
        )
    assert len(machine._relays) == MAX_RELAYS_PER_ORIGIN
    assert machine.counters["dropped_relays_per_origin"] == MAX_RELAYS_PER_ORIGIN
    nack = 0.1 + 2 * FAST.indirect_timeout_s  # the clamp, whatever the asker said
    machine.tick(nack + 0.01)
    machine.tick(nack + 2 * FAST.indirect_timeout_s + 0.02)  # then the late-ack wait
    assert not machine._relays


def test_one_sender_costs_a_bounded_number_of_signature_checks_a_second() -> None:
    """512 checks a message, 50 messages a second from one key: a second of the event
    loop's time every second."""
    from agora_node.comms.membership.budgets import VERIFY_RATE_PER_SENDER

    me, stranger = Identity.generate(), Identity.generate()
    machine, _ = lone_machine(me)
    forged = [item(stranger, Status.ALIVE, Identity.generate().peer_id, 0) for _ in range(64)]
    forged = [f[:-1] + bytes([f[-1] ^ 1]) for f in forged]  # bad signatures: never applied
    checked = 0
    for seq in range(1, 201):  # 200 messages of 64 forged items within one second
        before = machine.counters["dropped_bad_item_signature"]
        machine.on_message(stranger.peer_id, _gossip(stranger, me.peer_id, seq, forged), 0.5)
        checked += machine.counters["dropped_bad_item_signature"] - before
    assert checked <= 2 * VERIFY_RATE_PER_SENDER  # its burst, not 200 x 64
    assert machine.counters["dropped_over_verify_budget"] >= 200 * 64 - checked


def test_a_confirmer_must_have_answered_our_probe_or_be_a_member_for_a_while() -> None:
    from agora_node.comms.membership.members import Member
    from agora_node.comms.membership.swim import CONFIRMER_AGE_S, Membership

    fresh = Member("k", Status.ALIVE, 0, MemberMeta(), b"", since=100.0)
    assert not Membership._may_confirm(fresh, now=101.0)
    assert Membership._may_confirm(fresh, now=100.0 + CONFIRMER_AGE_S)
    fresh.add_rtt(0.05)  # answered one of our probes
    assert Membership._may_confirm(fresh, now=101.0)
    suspect = Member("s", Status.SUSPECT, 0, MemberMeta(), b"", since=0.0)
    assert not Membership._may_confirm(suspect, now=1000.0)
    assert not Membership._may_confirm(None, now=1000.0)


def test_a_member_restarted_below_its_earlier_incarnation_outbids_it() -> None:
    """Its earlier life's record (self-signed, at 5000) comes back with an accusation at
    5000; restarted at 4000 it dropped the accusation as ahead of it, and stayed
    suspected in every other view."""
    me, accuser = Identity.generate(), Identity.generate()
    machine, _ = lone_machine(me, incarnation_start=4000)
    old_record = item(me, Status.ALIVE, me.peer_id, 5000, meta=MemberMeta(stage=0))
    accusation = item(accuser, Status.SUSPECT, me.peer_id, 5000)
    entry = wire.entry_bytes(Status.SUSPECT, 5000, old_record, accusation)
    body = wire.push_pull_body(True, [entry])
    machine.on_message(
        accuser.peer_id, message(accuser, me.peer_id, MsgKind.PUSH_PULL, 1, body), 0.1
    )
    assert machine.incarnation > 5000


def test_the_incarnation_saturates_at_the_top_of_the_wire_format() -> None:
    me, accuser = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me, incarnation_start=TOP - 1)
    for seq, inc in enumerate((TOP - 1, TOP), 1):  # honest accusations at what it knows
        suspect = item(accuser, Status.SUSPECT, me.peer_id, inc)
        machine.on_message(accuser.peer_id, _gossip(accuser, me.peer_id, seq, [suspect]), 0.1)
    assert machine.incarnation == TOP
    machine.update_meta(MemberMeta(stage=2), 0.2)  # signs and sends: no struct.error
    assert machine.incarnation == TOP and out.sent


async def test_sends_held_to_one_peer_are_bounded() -> None:
    """A stranger whose handler never answers (or a fresh key with no host) held a send slot
    per message sent to it, up to the send timeout: enough of them filled all 256 and the
    member dropped its acks to everyone else."""
    me = Identity.generate()
    p2p = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: me.peer_id))
    service = MembershipService(p2p, me)
    gate = asyncio.Event()

    async def silent(to: str, data: bytes) -> None:
        await gate.wait()

    service._send_one = silent  # type: ignore[method-assign]
    for _ in range(3 * MAX_IN_FLIGHT_TO_ONE):
        service._send("silent-stranger", b"x")
    service._send("honest", b"x")
    assert service.send_overflows == 2 * MAX_IN_FLIGHT_TO_ONE
    assert len(service._in_flight) == MAX_IN_FLIGHT_TO_ONE + 1  # the honest peer's went out
    gate.set()
    await asyncio.gather(*service._in_flight)
    assert not service._in_flight and not service._in_flight_to
