"""Wire format and signatures: every bad message is dropped and counted.

These use real Ed25519 identities and the verifier the daemon uses."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from swim_helpers import item, lone_machine, message

from agora_node.comms.membership import messages as wire
from agora_node.comms.membership.messages import MalformedMessage, MemberMeta, MsgKind, Status
from agora_node.comms.membership.signing import Ed25519Verifier
from agora_node.protocol.identity import Identity

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair():
    """A machine (`me`) and a peer it knows (`alice`), both with real keys."""
    me, alice = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me)
    machine.learn([item(alice, Status.ALIVE, alice.peer_id, 0, meta=MemberMeta())], 0.0)
    return machine, out, me, alice


def _ping(sender: Identity, to: str, seq: int, **kw) -> bytes:
    return message(sender, to, MsgKind.PING, seq, wire.probe_body(7), **kw)


def test_valid_ping_is_answered(pair) -> None:
    machine, out, me, alice = pair
    machine.on_message(alice.peer_id, _ping(alice, me.peer_id, 1), 0.1)
    assert out.kinds_to(alice.peer_id) == [MsgKind.ACK]
    ack = wire.decode_envelope(out.sent[-1][1])
    signed = wire.envelope_signing_input(me.peer_id, alice.peer_id, ack.unsigned_part)
    assert Ed25519Verifier()(me.peer_id, signed, ack.signature)


def test_forged_message_is_dropped(pair) -> None:
    machine, out, me, alice = pair
    mallory = Identity.generate()
    forged = _ping(mallory, me.peer_id, 1)  # signed by mallory, claims to be alice
    machine.on_message(alice.peer_id, forged, 0.1)
    assert machine.counters["dropped_bad_signature"] == 1 and out.sent == []


def test_altered_message_is_dropped(pair) -> None:
    machine, out, me, alice = pair
    data = bytearray(_ping(alice, me.peer_id, 1))
    data[12] ^= 0x01  # flip a bit of the probe sequence number
    machine.on_message(alice.peer_id, bytes(data), 0.1)
    assert machine.counters["dropped_bad_signature"] == 1 and out.sent == []


def test_message_for_someone_else_is_dropped(pair) -> None:
    machine, out, me, alice = pair
    other = Identity.generate()
    machine.on_message(alice.peer_id, _ping(alice, other.peer_id, 1), 0.1)
    assert machine.counters["dropped_bad_signature"] == 1


def test_replayed_message_is_dropped(pair) -> None:
    machine, out, me, alice = pair
    data = _ping(alice, me.peer_id, 5)
    machine.on_message(alice.peer_id, data, 0.1)
    machine.on_message(alice.peer_id, data, 0.2)
    assert machine.counters["dropped_replay"] == 1
    assert out.kinds_to(alice.peer_id) == [MsgKind.ACK]


def test_unsigned_message_is_dropped(pair) -> None:
    machine, out, me, alice = pair
    machine.on_message(alice.peer_id, _ping(alice, me.peer_id, 1, signed=False), 0.1)
    assert machine.counters["dropped_unsigned"] == 1 and out.sent == []


@pytest.mark.parametrize(
    "data",
    [b"", b"\x01", b"garbage" * 20, bytes(80), b"\x02" + bytes(100), b"\x01\x01\x63" + bytes(90)],
)
def test_malformed_message_is_dropped(pair, data: bytes) -> None:
    machine, out, me, alice = pair
    machine.on_message(alice.peer_id, data, 0.1)
    assert machine.counters["dropped_malformed"] == 1 and out.sent == []


def test_truncated_message_is_dropped(pair) -> None:
    machine, out, me, alice = pair
    data = _ping(alice, me.peer_id, 1, signed=True)
    machine.on_message(alice.peer_id, data[:-70], 0.1)
    assert machine.counters["dropped_malformed"] + machine.counters["dropped_bad_signature"] == 1


def test_forged_item_inside_a_valid_message_is_dropped(pair) -> None:
    machine, out, me, alice = pair
    victim, mallory = Identity.generate(), Identity.generate()
    # mallory cannot announce `victim` with a stage of its choosing...
    fake_alive = wire.item_body(Status.ALIVE, victim.peer_id, 9, meta=MemberMeta(stage=3))
    fake_alive += mallory.sign(wire.ITEM_DOMAIN + fake_alive)
    # ...nor make alice leave
    fake_left = wire.item_body(Status.LEFT, alice.peer_id, 0)
    fake_left += mallory.sign(wire.ITEM_DOMAIN + fake_left)
    gossip = message(mallory, me.peer_id, MsgKind.GOSSIP, 1, items=[fake_alive, fake_left])
    machine.on_message(mallory.peer_id, gossip, 0.1)
    assert machine.counters["dropped_bad_item_signature"] == 2
    assert machine.get(victim.peer_id) is None
    assert machine.get(alice.peer_id).status == Status.ALIVE


def test_stale_incarnation_is_ignored_and_counted(pair) -> None:
    machine, out, me, alice = pair
    bob = Identity.generate()
    newer = item(alice, Status.ALIVE, alice.peer_id, 3, meta=MemberMeta(stage=1))
    machine.on_message(bob.peer_id, message(bob, me.peer_id, MsgKind.GOSSIP, 1, items=[newer]), 0.1)
    assert machine.get(alice.peer_id).incarnation == 3
    old_suspect = item(bob, Status.SUSPECT, alice.peer_id, 2)
    old_alive = item(alice, Status.ALIVE, alice.peer_id, 1, meta=MemberMeta(stage=0))
    gossip = message(bob, me.peer_id, MsgKind.GOSSIP, 2, items=[old_suspect, old_alive])
    machine.on_message(bob.peer_id, gossip, 0.2)
    view = machine.get(alice.peer_id)
    assert view.status == Status.ALIVE and view.incarnation == 3 and view.meta.stage == 1
    assert machine.counters["stale_items"] == 2


def test_accusation_about_me_is_refuted_with_a_signed_record(pair) -> None:
    machine, out, me, alice = pair
    accusation = item(alice, Status.SUSPECT, me.peer_id, 0)
    machine.on_message(
        alice.peer_id, message(alice, me.peer_id, MsgKind.GOSSIP, 1, items=[accusation]), 0.1
    )
    assert machine.incarnation == 1 and machine.counters["refutations"] == 1
    sent = [wire.decode_envelope(d) for to, d in out.sent if to == alice.peer_id]
    records = [i for env in sent for i in env.items if i.subject == me.peer_id]
    assert records and records[0].kind == Status.ALIVE and records[0].incarnation == 1
    assert Ed25519Verifier()(me.peer_id, records[0].signing_input, records[0].signature)


def test_members_outside_a_private_swarm_are_dropped() -> None:
    me, alice, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    allowed = {me.peer_id, alice.peer_id}
    machine, out = lone_machine(me, admit=allowed.__contains__)
    machine.on_message(stranger.peer_id, _ping(stranger, me.peer_id, 1), 0.1)
    relayed = item(stranger, Status.ALIVE, stranger.peer_id, 0, meta=MemberMeta())
    machine.on_message(
        alice.peer_id, message(alice, me.peer_id, MsgKind.GOSSIP, 1, items=[relayed]), 0.1
    )
    assert machine.counters["dropped_not_admitted"] == 2
    assert machine.get(stranger.peer_id) is None and out.sent == []


def test_every_message_kind_round_trips() -> None:
    alice = Identity.generate()
    record = item(alice, Status.ALIVE, alice.peer_id, 4, meta=MemberMeta(stage=2, state="active"))
    accusation = item(alice, Status.SUSPECT, "12D3KooWother", 4)
    bodies = {
        MsgKind.PING: wire.probe_body(1),
        MsgKind.ACK: wire.probe_body(2),
        MsgKind.NACK: wire.probe_body(3),
        MsgKind.PING_REQ: wire.ping_req_body(4, "12D3KooWtarget", 150),
        MsgKind.GOSSIP: b"",
        MsgKind.PUSH_PULL: wire.push_pull_body(True, [wire.entry_bytes(Status.ALIVE, 4, record)]),
    }
    for kind, body in bodies.items():
        env = wire.decode_envelope(message(alice, "x", kind, 9, body, items=[record, accusation]))
        assert env.kind == kind and env.seq == 9 and env.signed
        assert [i.raw for i in env.items] == [record, accusation]
    env = wire.decode_envelope(message(alice, "x", MsgKind.PING_REQ, 1, bodies[MsgKind.PING_REQ]))
    assert (env.probe_seq, env.target, env.nack_after_ms) == (4, "12D3KooWtarget", 150)
    env = wire.decode_envelope(message(alice, "x", MsgKind.PUSH_PULL, 1, bodies[MsgKind.PUSH_PULL]))
    assert env.reply and env.entries[0].record.meta == MemberMeta(stage=2, state="active")


def test_ping_is_small() -> None:
    alice = Identity.generate()
    assert len(message(alice, "x", MsgKind.PING, 1, wire.probe_body(1))) == 80


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_rejects_garbage_only_with_malformed_message(data: bytes) -> None:
    with contextlib.suppress(MalformedMessage):
        wire.decode_envelope(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=255))
def test_decoder_survives_corrupted_valid_messages(position: int, value: int) -> None:
    alice = Identity.generate()
    record = item(alice, Status.ALIVE, alice.peer_id, 1, meta=MemberMeta(stage=1))
    body = wire.push_pull_body(False, [wire.entry_bytes(Status.ALIVE, 1, record)])
    data = bytearray(message(alice, "x", MsgKind.PUSH_PULL, 3, body, items=[record]))
    data[position % len(data)] = value
    with contextlib.suppress(MalformedMessage):
        wire.decode_envelope(bytes(data))


def test_a_push_pull_of_forged_entries_costs_at_most_the_verify_budget(pair) -> None:
    """A stranger's push-pull of many entries for unknown members, each signed by the
    stranger instead of its subject: the machine checks at most VERIFY_BUDGET signatures
    for the message (the loop's time), learns none of them, and counts the rest."""
    from agora_node.comms.membership.budgets import VERIFY_BUDGET

    machine, out, me, alice = pair
    mallory = Identity.generate()
    calls = []
    verify = machine._verify
    machine._verify = lambda *a: calls.append(1) or verify(*a)
    entries = []
    for _ in range(VERIFY_BUDGET + 300):
        subject = Identity.generate().peer_id
        body = wire.item_body(Status.ALIVE, subject, 1, meta=MemberMeta(stage=0))
        entries.append(
            wire.entry_bytes(Status.ALIVE, 1, body + mallory.sign(wire.ITEM_DOMAIN + body))
        )
    data = message(mallory, me.peer_id, MsgKind.PUSH_PULL, 1, wire.push_pull_body(False, entries))
    machine.on_message(mallory.peer_id, data, 0.1)
    assert len(calls) == 1 + VERIFY_BUDGET  # the envelope, then the budget
    assert machine.counters["dropped_bad_item_signature"] == VERIFY_BUDGET
    assert machine.counters["dropped_over_verify_budget"] == 300
    assert machine.get(subject) is None and machine.get(alice.peer_id).status == Status.ALIVE


def test_a_push_pull_cannot_claim_more_entries_than_a_table_holds() -> None:
    body = bytes([0]) + (wire.MAX_ENTRIES + 1).to_bytes(4, "big") + b"\0" * 64
    envelope = wire.encode_envelope(MsgKind.PUSH_PULL, 1, body, [], signed=False)
    with pytest.raises(MalformedMessage, match="at most"):
        wire.decode_envelope(envelope)
