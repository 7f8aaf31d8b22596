"""SWIM failure detection and membership with Lifeguard, as a pure state machine.

No I/O, no asyncio, no threads: the owner calls `tick(now)` when `next_deadline()`
has passed and `on_message(sender, data, now)` for each message that arrives;
the machine calls the injected `send(peer_id, data)` and reports every change
of another member's status or metadata to the injected listener. Randomness
comes from an injected `random.Random`, so runs replay exactly in the simulator.

Protocol, per probe period (stretched by the local-health multiplier):
ping one member (round-robin over a shuffled list); no ack within the probe
timeout -> ping-req through `indirect_checks` members, who ack or nack; no ack
by the end of the period -> suspect it. A suspect refutes by raising its
incarnation; otherwise it is declared dead when its suspicion timeout, shrunk by
independent confirmations, expires. News rides on every message and on gossip
messages sent while there is news; a periodic push-pull syncs full state, and a
reconnect timer pings dead members and seeds so that healed partitions merge.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agora_node.comms.membership import messages as wire
from agora_node.comms.membership.budgets import SenderBudgets
from agora_node.comms.membership.dissemination import GossipQueue
from agora_node.comms.membership.lifeguard import Awareness, Suspicion
from agora_node.comms.membership.members import (
    ACCUSATIONS,
    LIVE,
    Member,
    MemberTable,
    MemberView,
    precedence,
)
from agora_node.comms.membership.messages import Item, MemberMeta, MsgKind, Status
from agora_node.comms.membership.replay import ReplayGuard
from agora_node.comms.membership.settings import MembershipSettings
from agora_node.comms.membership.signing import Signer, Verifier
from agora_node.comms.membership.timers import Timer, TimerQueue

__all__ = ["Membership", "MemberView", "COUNTERS"]

COUNTERS = (
    "sent", "sent_bytes", "received", "received_bytes",
    "dropped_malformed", "dropped_unsigned", "dropped_bad_signature", "dropped_replay",
    "dropped_not_admitted", "dropped_bad_item_signature", "stale_items",
    "dropped_table_full", "dropped_relays_full", "dropped_over_verify_budget",
    "probes", "probe_failures", "probes_inconclusive", "indirect_probes",
    "suspicions", "confirmations", "declared_dead", "refutations", "push_pulls",
    "dropped_future_accusations", "dropped_unknown_confirmers", "dropped_replies",
    "dropped_push_pulls", "dropped_relays_per_origin",
)  # fmt: skip

_KEPT_SEEDS = 8
"""Seeds never dropped when the seed list is full: the first ones, given at start."""

# timer kinds
_PROBE, _PROBE_TIMEOUT, _PROBE_END, _SUSPICION, _NACK, _GOSSIP, _PUSH_PULL, _RECONNECT = range(8)


MAX_INCARNATION = 2**32 - 1
"""Incarnations travel as u32: ours saturates there."""
MAX_REPLY_ITEMS = 16
"""Corrections one received message may earn its sender (stale news about us or others,
sent back in one message): a message of 255 stale items once earned 255 signed sends."""
CONFIRMER_AGE_S = 30.0
"""How long a member we never probed must have been a live member before its accusations
confirm a suspicion (`_may_confirm`)."""
MAX_RELAYS_PER_ORIGIN = 8
"""Ping-reqs of one origin carried at once (an honest prober asks each helper once per
probe); the relay table is shared by all."""


@dataclass(slots=True)
class _Probe:
    target: str
    seq: int
    started: float
    relays: set[str] = field(default_factory=set)
    nacks: int = 0
    retried: bool = False  # timed out once: pinged again and asked relays
    timer: Timer | None = None
    verifying: Suspicion | None = None  # a last check before declaring death


@dataclass(slots=True)
class _Relay:
    """A ping-req we carry out for `origin`."""

    origin: str
    origin_seq: int
    target: str
    started: float
    acked: bool = False
    nacked: bool = False


class Membership:
    """One member's SWIM/Lifeguard state machine (see the module docstring)."""

    def __init__(
        self,
        signer: Signer,
        verify: Verifier,
        *,
        send: Callable[[str, bytes], None],
        rng: random.Random,
        now: float,
        settings: MembershipSettings | None = None,
        meta: MemberMeta | None = None,
        listener: Callable[[MemberView], None] | None = None,
        seq_start: int = 0,
        admit: Callable[[str], bool] | None = None,
        incarnation_start: int = 0,
    ) -> None:
        """`seq_start` must grow across restarts of one identity (e.g. wall-clock
        microseconds), or peers drop the restarted member's messages as replays.
        `incarnation_start` likewise (e.g. wall-clock seconds): a restarted member then
        starts above every incarnation its earlier life reached, so an accusation above
        its incarnation is nobody's honest view and is ignored (one signed SUSPECT at
        2**32 - 1 had pushed the incarnation off the wire format and broke the member).
        `admit`, if given, says which peer ids may take part (a private swarm)."""
        self.peer_id = signer.peer_id
        self.settings = settings or MembershipSettings()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.awareness = Awareness(self.settings.max_awareness)
        self._signer, self._verify, self._send_fn = signer, verify, send
        self._budget: int | None = None
        """Signature checks left for the message being handled (None: not in one)."""
        self._rng, self._listener, self._admit = rng, listener, admit
        self._members = MemberTable(rng)
        self._incarnation = min(max(0, incarnation_start), MAX_INCARNATION)
        self._meta = meta or MemberMeta()
        self._record = self._sign_item(
            Status.ALIVE, self.peer_id, self._incarnation, meta=self._meta
        )
        self._replies: dict[str, dict[bytes, None]] | None = None
        """Corrections owed to senders of the message being handled (None: not in one)."""
        self._refuted = False
        """An accusation in the message being handled made us refute: one a message."""
        self._budgets = SenderBudgets(
            2 * self.settings.max_members, self.settings.push_pull_interval_s, now
        )
        self._leaving = False
        self._gossip = GossipQueue()
        self._replay = ReplayGuard(max_senders=2 * self.settings.max_members)
        self._timers = TimerQueue()
        self._seq = seq_start
        self._probe_seq = 0
        self._probes: dict[int, _Probe] = {}  # in flight; periods may overlap
        # last-check probes before a death, one at a time so that a mass failure
        # does not turn into a storm of probes
        self._verifying: Suspicion | None = None
        self._verify_queue: list[Suspicion] = []
        self._relays: dict[int, _Relay] = {}
        self._reconnect_pings: dict[int, str] = {}
        self._seeds: list[str] = []
        self._start_timers(now)

    # ---------------------------------------------------------------- public API

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def meta(self) -> MemberMeta:
        return self._meta

    @property
    def leaving(self) -> bool:
        return self._leaving

    def cluster_size(self) -> int:
        """Live members including this one: the n in the log(n) formulas."""
        return self._members.live + 1

    def members(self) -> list[MemberView]:
        """Every other member remembered, whatever its status."""
        return [m.view() for m in self._members.by_id.values()]

    def alive_members(self) -> list[MemberView]:
        """Other members that are alive or suspected (not yet declared dead)."""
        return [m.view() for m in self._members.by_id.values() if m.status in LIVE]

    def get(self, peer_id: str) -> MemberView | None:
        member = self._members.get(peer_id)
        return None if member is None else member.view()

    def rtt(self, peer_id: str) -> float | None:
        """Our measured round trip to `peer_id` (members.Member.rtt), None before the first."""
        member = self._members.get(peer_id)
        return None if member is None else member.rtt()

    def next_deadline(self) -> float:
        """When `tick` next has work to do."""
        return self._timers.next_deadline()

    @property
    def record(self) -> bytes:
        """Our current self-signed ALIVE (or LEFT) record, as gossiped."""
        return self._record

    def learn(self, records: Iterable[bytes | Item], now: float) -> None:
        """Add members from their self-signed records (e.g. found in a directory, or
        a simulator starting converged); they are probed but not gossiped."""
        for raw in records:
            try:
                item = raw if isinstance(raw, Item) else wire.decode_item(raw)
            except wire.MalformedMessage:
                self.counters["dropped_malformed"] += 1
                continue
            if item.kind in (Status.ALIVE, Status.LEFT):
                self._apply_item(item, now, gossip=False, count_stale=False)

    def join(self, seeds: Iterable[str], now: float) -> None:
        """Sync full state with each new seed. Seeds are remembered: while we are
        alone we sync with a few of them again, and unknown ones are pinged to merge
        healed partitions."""
        fresh = [s for s in dict.fromkeys(seeds) if s != self.peer_id and s not in self._seeds]
        self._seeds.extend(fresh)
        # bounded like the table: the first seeds (the ones given at start) are kept
        excess = len(self._seeds) - self.settings.max_members
        if excess > 0:
            del self._seeds[_KEPT_SEEDS : _KEPT_SEEDS + excess]
        for seed in fresh:
            self._send_push_pull(seed, reply=False)

    def update_meta(self, meta: MemberMeta, now: float) -> None:
        """Announce new metadata (stage, state) under a new incarnation (no-op if unchanged)."""
        if meta == self._meta:
            return
        self._meta = meta
        self._set_incarnation(self._incarnation + 1)

    def leave(self, now: float) -> None:
        """Announce a graceful leave; probing stops, answering continues until dropped."""
        if self._leaving:
            return
        self._leaving = True
        self._record = self._sign_item(Status.LEFT, self.peer_id, self._incarnation)
        self._spread(self.peer_id, self._record, Status.LEFT)
        for peer in self._gossip_targets(max(3, self.settings.gossip_fanout), now):
            self._send(peer, MsgKind.GOSSIP, b"")

    def tick(self, now: float) -> None:
        handlers = (
            self._on_probe_timer,
            self._on_probe_timeout,
            self._on_probe_end,
            self._on_suspicion_timer,
            self._on_nack_timer,
            self._on_gossip_timer,
            self._on_push_pull_timer,
            self._on_reconnect_timer,
        )
        for timer in self._timers.pop_due(now):
            handlers[timer.kind](timer.key, timer.when, now)

    def on_message(self, sender: str, data: bytes, now: float) -> None:
        """Verify and handle one message; bad ones are dropped and counted. One message
        gets at most budgets.VERIFY_BUDGET signature checks of the items in it (the event loop's
        time is what a stranger's push-pull of forged entries would spend)."""
        self.counters["received"] += 1
        self.counters["received_bytes"] += len(data)
        env = self._open(sender, data)
        if env is None:
            return
        known = self._members.get(sender)
        probed = known is not None and known.status == Status.ALIVE and known.rtt() is not None
        budget, buckets = self._budgets.checks(sender, probed, now)
        self._budget, self._replies = budget, {}
        try:
            self._handle(sender, env, now)
        finally:
            for bucket in buckets:
                bucket.spend(budget - (self._budget or 0))
            replies, self._budget, self._replies = self._replies, None, None
            self._refuted = False
            for peer, items in replies.items():
                self._send(peer, MsgKind.GOSSIP, b"", list(items))

    def _handle(self, sender: str, env: wire.Envelope, now: float) -> None:
        for item in env.items:
            self._apply_item(item, now, gossip=True, sender=sender)
        kind = env.kind
        if kind == MsgKind.PING:
            self._send(sender, MsgKind.ACK, wire.probe_body(env.probe_seq))
        elif kind == MsgKind.ACK:
            self._on_ack(sender, env.probe_seq, now)
        elif kind == MsgKind.NACK:
            probe = self._probes.get(env.probe_seq)
            if probe is not None and sender in probe.relays:
                probe.nacks += 1
        elif kind == MsgKind.PING_REQ:
            self._on_ping_req(sender, env, now)
        elif kind == MsgKind.PUSH_PULL:
            self._merge_state(sender, env.entries, now)
            if env.reply:
                return
            if self._budgets.may_answer_push_pull(sender, now):
                self._send_push_pull(sender, reply=True)
            else:
                self.counters["dropped_push_pulls"] += 1

    # ------------------------------------------------------------ message I/O

    def _open(self, sender: str, data: bytes) -> wire.Envelope | None:
        counters = self.counters
        if self._admit is not None and not self._admit(sender):
            counters["dropped_not_admitted"] += 1
            return None
        try:
            env = wire.decode_envelope(data)
        except wire.MalformedMessage:
            counters["dropped_malformed"] += 1
            return None
        if not env.signed:
            counters["dropped_unsigned"] += 1
            return None
        signed = wire.envelope_signing_input(sender, self.peer_id, env.unsigned_part)
        if not self._verify(sender, signed, env.signature):
            counters["dropped_bad_signature"] += 1
            return None
        if not self._replay.accept(sender, env.seq):
            counters["dropped_replay"] += 1
            return None
        return env

    def _send(self, to: str, kind: MsgKind, body: bytes, first: Iterable[bytes] = ()) -> None:
        items = list(first)
        items += self._gossip.take(
            self.settings.max_piggyback - len(items),
            self.settings.retransmit_limit(self.cluster_size()),
        )
        self._seq += 1
        unsigned = wire.encode_envelope(kind, self._seq, body, items)
        data = unsigned + self._signer.sign(wire.envelope_signing_input(self.peer_id, to, unsigned))
        self.counters["sent"] += 1
        self.counters["sent_bytes"] += len(data)
        self._send_fn(to, data)

    def _sign_item(
        self, kind: Status, subject: str, incarnation: int, *, meta: MemberMeta | None = None
    ) -> bytes:
        accuser = self.peer_id if kind in (Status.SUSPECT, Status.DEAD) else None
        body = wire.item_body(kind, subject, incarnation, meta=meta, accuser=accuser)
        return body + self._signer.sign(wire.ITEM_DOMAIN + body)

    def _next_probe_seq(self) -> int:
        self._probe_seq = (self._probe_seq + 1) & 0xFFFFFFFF
        return self._probe_seq

    # ------------------------------------------------------------------ probing

    def _start_timers(self, now: float) -> None:
        s, rng = self.settings, self._rng
        # random phases keep members from probing and syncing in lockstep
        self._timers.add(now + rng.uniform(0, s.probe_interval_s), _PROBE)
        self._timers.add(now + rng.uniform(0, s.gossip_interval_s), _GOSSIP)
        self._timers.add(now + rng.uniform(0, s.push_pull_interval_s), _PUSH_PULL)
        self._timers.add(now + rng.uniform(0, s.reconnect_interval_s), _RECONNECT)

    def _on_probe_timer(self, _key: object, _when: float, now: float) -> None:
        if self._leaving:
            return
        self._timers.add(now + self.awareness.scale(self.settings.probe_interval_s), _PROBE)
        target = self._members.next_probe_target()
        if target is not None:
            self._start_probe(target, now)

    def _start_probe(self, target: str, now: float, verifying: Suspicion | None = None) -> None:
        self.counters["probes"] += 1
        probe = _Probe(target, self._next_probe_seq(), now, verifying=verifying)
        self._probes[probe.seq] = probe
        member = self._members.by_id[target]
        # Lifeguard buddy system: tell a suspect it is suspected, so it can refute
        accusation = member.accusation if member.status == Status.SUSPECT else None
        first = [accusation.raw] if accusation is not None else []
        self._send(target, MsgKind.PING, wire.probe_body(probe.seq), first)
        timeout = self.awareness.scale(self.settings.probe_timeout_s)
        probe.timer = self._timers.add(now + timeout, _PROBE_TIMEOUT, probe.seq)

    def _on_probe_timeout(self, seq: int, _when: float, now: float) -> None:
        probe = self._probes.get(seq)
        if probe is None:
            return
        indirect = self.awareness.scale(self.settings.indirect_timeout_s)
        probe.timer = self._timers.add(now + indirect, _PROBE_END, seq)
        probe.retried = True
        # a second direct ping (memberlist's TCP fallback, in spirit) rescues most
        # probes that failed only because one datagram was lost
        self._send(probe.target, MsgKind.PING, wire.probe_body(seq))
        relays = self._members.sample(self.settings.indirect_checks, exclude=probe.target)
        # relays nack halfway through, so that the nack is back before the end
        body = wire.ping_req_body(seq, probe.target, int(indirect * 500))
        for relay in relays:
            probe.relays.add(relay)
            self.counters["indirect_probes"] += 1
            self._send(relay, MsgKind.PING_REQ, body)

    def _on_probe_end(self, seq: int, when: float, now: float) -> None:
        probe = self._probes.pop(seq, None)
        if probe is None:
            return
        # a timer that fires much too late means this node is the slow one
        late = now - when > self.awareness.scale(self.settings.probe_timeout_s)
        if late:
            self.counters["probes_inconclusive"] += 1
            self.awareness.apply(1)
            if probe.verifying is not None:  # check again once we are on time
                wait = self.awareness.scale(self.settings.probe_interval_s)
                self._timers.add(now + wait, _SUSPICION, probe.verifying)
                self._next_verification(now)
            return
        self.counters["probe_failures"] += 1
        missing = len(probe.relays) - probe.nacks if probe.relays else 1
        self.awareness.apply(max(0, missing))
        member = self._members.get(probe.target)
        if member is not None and member.status in LIVE:
            if probe.verifying is not None and member.suspicion is probe.verifying:
                self._accuse(member, Status.DEAD, now)
            else:
                self._accuse(member, Status.SUSPECT, now)
        if probe.verifying is not None:
            self._next_verification(now)

    def _on_ack(self, sender: str, seq: int, now: float) -> None:
        probe = self._probes.get(seq)
        if probe is not None:
            if sender == probe.target or sender in probe.relays:
                del self._probes[seq]
                if probe.timer is not None:
                    probe.timer.cancel()
                self.awareness.apply(-1)
                member = self._members.get(sender)
                if member is not None and sender == probe.target:
                    member.acked = True  # a host behind the id, however far (late acks too)
                    if not probe.retried:
                        member.add_rtt(now - probe.started)  # the first ping, answered directly
                if probe.verifying is not None:
                    # alive after all: wait for its refutation, and check again if none comes
                    wait = self.awareness.scale(self.settings.probe_interval_s)
                    self._timers.add(now + wait, _SUSPICION, probe.verifying)
                    self._next_verification(now)
            return
        relay = self._relays.get(seq)
        if relay is not None and sender == relay.target and not relay.acked:
            relay.acked = True
            self._send(relay.origin, MsgKind.ACK, wire.probe_body(relay.origin_seq))
            return
        peer = self._reconnect_pings.pop(seq, None)
        if peer is not None and peer == sender:
            self._send_push_pull(peer, reply=False)  # a "dead" member answers: merge views

    def _on_ping_req(self, origin: str, env: wire.Envelope, now: float) -> None:
        target = env.target
        if target is None or target == self.peer_id or target == origin:
            return
        if len(self._relays) >= self.settings.max_relays:
            self.counters["dropped_relays_full"] += 1
            return
        if sum(r.origin == origin for r in self._relays.values()) >= MAX_RELAYS_PER_ORIGIN:
            self.counters["dropped_relays_per_origin"] += 1
            return
        seq = self._next_probe_seq()
        self._relays[seq] = _Relay(origin, env.probe_seq, target, now)
        self._send(target, MsgKind.PING, wire.probe_body(seq))
        # an honest origin asks for a nack within its own indirect wait; a slot held longer
        # (65 s at most on the wire, twice that with the late-ack wait) is a held slot
        nack_after = min(env.nack_after_ms / 1000.0, 2 * self.settings.indirect_timeout_s)
        self._timers.add(now + nack_after, _NACK, seq)

    def _on_nack_timer(self, seq: int, when: float, now: float) -> None:
        relay = self._relays.get(seq)
        if relay is None or relay.acked or relay.nacked:
            self._relays.pop(seq, None)
            return
        relay.nacked = True
        self._send(relay.origin, MsgKind.NACK, wire.probe_body(relay.origin_seq))
        # still forward a late ack for as long again: the origin may be waiting
        self._timers.add(now + max(when - relay.started, 0.05), _NACK, seq)

    # ----------------------------------------------------------- state changes

    def _set(
        self, member: Member, status: Status, incarnation: int, now: float, *, emit: bool = True
    ) -> None:
        self._members.set_status(member, status, incarnation, now)
        if emit and self._listener is not None:
            self._listener(member.view())

    def _accuse(self, member: Member, kind: Status, now: float) -> None:
        """Suspect (or declare dead) a member on our own evidence, signed by us."""
        suspicion = member.suspicion
        if kind == Status.SUSPECT and suspicion is not None and self.peer_id in suspicion.accusers:
            return
        raw = self._sign_item(kind, member.peer_id, member.incarnation)
        item = wire.decode_item(raw)
        if kind == Status.SUSPECT:
            if suspicion is not None:  # already suspected by others: we confirm it
                self._confirm(suspicion, item)
            else:
                self._start_suspicion(member, item, now)
            # tell the suspect directly too: a live one refutes long before the timeout
            self._send(member.peer_id, MsgKind.GOSSIP, b"", [raw])
        else:
            self.counters["declared_dead"] += 1
            self._set(member, Status.DEAD, item.incarnation, now)
            member.accusation = item
        self._spread(member.peer_id, raw, kind)

    def _start_suspicion(self, member: Member, item: Item, now: float) -> None:
        self.counters["suspicions"] += 1
        n = self.cluster_size()
        low, high = self.settings.suspicion_bounds(n)
        expected = self.settings.suspicion_confirmations
        if n - 2 < expected:
            expected = 0  # too few members to ever confirm: use the shortest timeout
        self._set(member, Status.SUSPECT, item.incarnation, now)
        suspicion = Suspicion(
            member.peer_id, item.incarnation, now, low, high, expected, {item.signer}
        )
        member.suspicion = suspicion
        member.accusation = item
        self._timers.add(suspicion.deadline, _SUSPICION, suspicion)
        if suspicion.deadline > now + low:
            self._timers.add(now + low, _SUSPICION, suspicion)

    def _on_suspicion_timer(self, suspicion: Suspicion, _when: float, now: float) -> None:
        member = self._members.get(suspicion.subject)
        if member is None or member.suspicion is not suspicion:
            return
        if now + 1e-9 < suspicion.deadline:
            # Still unconfirmed after the shortest timeout: the death may have been
            # declared and its gossip missed us; relaying our suspicion again makes
            # members who know better correct us.
            if not suspicion.regossiped and member.accusation is not None:
                suspicion.regossiped = True
                self._gossip.push(member.peer_id, member.accusation.raw)
            return
        if suspicion.confirmations >= max(1, suspicion.expected):
            self._accuse(member, Status.DEAD, now)
            return
        # Not confirmed by enough others (in a tiny cluster: by anyone else): it may
        # have refuted and the news missed us (gossip reaches everyone only with high
        # probability). Probe it once more, with the suspicion attached; only a
        # failed probe makes it dead.
        self._request_verification(suspicion, now)

    def _request_verification(self, suspicion: Suspicion, now: float) -> None:
        if suspicion is self._verifying or suspicion in self._verify_queue:
            return
        if self._verifying is None:
            self._verifying = suspicion
            self._start_probe(suspicion.subject, now, verifying=suspicion)
        else:
            self._verify_queue.append(suspicion)

    def _next_verification(self, now: float) -> None:
        self._verifying = None
        while self._verify_queue:
            suspicion = self._verify_queue.pop(0)
            member = self._members.get(suspicion.subject)
            if member is not None and member.suspicion is suspicion:
                self._request_verification(suspicion, now)
                return

    def _set_incarnation(self, incarnation: int) -> None:
        """(At MAX_INCARNATION a member can outbid nothing more: it stays there.)"""
        self._incarnation = min(incarnation, MAX_INCARNATION)
        if not self._leaving:
            self._record = self._sign_item(
                Status.ALIVE, self.peer_id, self._incarnation, meta=self._meta
            )
            self._gossip.push(self.peer_id, self._record)

    def _refute(self, incarnation: int) -> None:
        """Someone believes an older or worse version of us: outbid it."""
        if self._leaving:
            return
        self.counters["refutations"] += 1
        self.awareness.apply(1)
        self._set_incarnation(max(self._incarnation, incarnation) + 1)

    # ------------------------------------------------------------ gossip items

    def _apply_item(
        self,
        item: Item,
        now: float,
        *,
        gossip: bool,
        count_stale: bool = True,
        sender: str | None = None,
    ) -> None:
        """Apply one signed item if it is news; relay it if `gossip`."""
        if item.subject == self.peer_id:
            self._about_me(item, sender, count_stale)
            return
        member = self._members.get(item.subject)
        action = precedence(member, item)
        if action is None:
            self.counters["stale_items"] += count_stale
            if sender is not None and member is not None and item.kind in ACCUSATIONS:
                self._correct(sender, member, item)
            return
        if item.kind == Status.ALIVE and self._admit is not None and not self._admit(item.subject):
            self.counters["dropped_not_admitted"] += 1
            return
        if not self._verified(item):
            return
        if member is None and not self._make_room():
            return
        if action == "confirm":
            assert member is not None and member.suspicion is not None
            if not self._may_confirm(self._members.get(item.signer), now):
                self.counters["dropped_unknown_confirmers"] += 1
                return
            self._confirm(member.suspicion, item)
        elif item.kind == Status.SUSPECT:
            assert member is not None
            self._start_suspicion(member, item, now)
        elif item.kind == Status.DEAD and member is not None and not self._believes(member):
            self._verify_death(member, item, now)
            return
        else:
            self._apply_record(member, item, now)
        if gossip:
            self._spread(item.subject, item.raw, item.kind)

    @staticmethod
    def _may_confirm(confirmer: Member | None, now: float) -> bool:
        """Whether a confirmation by this accuser counts: a live member that answered our
        own probe, or that has been one for CONFIRMER_AGE_S. Keys cost nothing, and a
        self-signed ALIVE makes one a member in one message: four fresh keys' SUSPECTs
        in one message declared a live member dead a second later."""
        if confirmer is None or confirmer.status != Status.ALIVE:
            return False
        return confirmer.rtt() is not None or now - confirmer.since >= CONFIRMER_AGE_S

    def _make_room(self) -> bool:
        """Room for one more member: the table is bounded (identities are free), so a full
        one forgets the member gone longest, and takes nobody new while all are live."""
        if len(self._members.by_id) < self.settings.max_members:
            return True
        evicted = self._members.evict_gone()
        if evicted is None:
            self.counters["dropped_table_full"] += 1
            return False
        self._replay.forget(evicted)
        return True

    def _correct(self, sender: str, member: Member, item: Item) -> None:
        """The sender relays an accusation we know to be outdated (the member has
        refuted, left or died since): send it our newer statement. Gossip reaches
        everyone only with high probability; this mends the few it missed."""
        if member.status == Status.LEFT or member.incarnation > item.incarnation:
            newer = member.record
        elif member.status == Status.DEAD and item.kind == Status.SUSPECT and member.accusation:
            newer = member.accusation.raw
        else:
            return
        self._reply(sender, newer)

    def _confirm(self, suspicion: Suspicion, item: Item) -> None:
        if suspicion.confirm(item.signer):
            self.counters["confirmations"] += 1
            self._timers.add(suspicion.deadline, _SUSPICION, suspicion)

    def _apply_record(self, member: Member | None, item: Item, now: float) -> None:
        """ALIVE, DEAD or LEFT news about another member that `precedence` accepted."""
        if member is None:
            meta = item.meta or MemberMeta()
            member = Member(item.subject, item.kind, item.incarnation, meta, item.raw, now)
            self._members.add(member)
            if self._listener is not None:
                self._listener(member.view())
            return
        if item.kind == Status.DEAD:
            self._set(member, Status.DEAD, item.incarnation, now)
            member.accusation = item
            return
        member.record = item.raw
        member.accusation = None
        meta_changed = item.meta is not None and item.meta != member.meta
        if item.meta is not None:
            member.meta = item.meta
        emit = item.kind != member.status or meta_changed
        self._set(member, item.kind, item.incarnation, now, emit=emit)

    def _about_me(self, item: Item, sender: str | None, count_stale: bool = True) -> None:
        accusation = item.kind in (Status.SUSPECT, Status.DEAD)
        if accusation and item.incarnation > self._incarnation:
            # above any incarnation we ever had (incarnation_start): forged, not refuted
            self.counters["dropped_future_accusations"] += 1
            return
        worse = item.kind != Status.ALIVE and item.incarnation >= self._incarnation
        newer = item.kind == Status.ALIVE and item.incarnation > self._incarnation
        if not (worse or newer) or self._leaving:
            self.counters["stale_items"] += count_stale
            if accusation and sender is not None and not self._leaving:
                self._reply(sender, self._record)  # it relays old news about us: update it
            return
        if accusation and self._refuted:
            # A chain in one message (accusations at i, i+1, ...: each "at our incarnation"
            # once the one before is refuted) raised it by 255 and sent 510 messages.
            self.counters["stale_items"] += count_stale
            return
        if self._verified(item):
            self._refute(item.incarnation)
            self._refuted = accusation and self._replies is not None
            # the accuser and the relay hear it first-hand: gossip may miss a few
            for peer in dict.fromkeys((item.accuser, sender)):
                if peer is not None and peer != self.peer_id:
                    self._reply(peer, self._record)

    def _spread(self, subject: str, raw: bytes, kind: Status) -> None:
        """Queue news for piggy-backing. Deaths and leaves are sent twice as often:
        nothing else repairs a member that missed one (a live member's refutation
        is repaired by the member itself, a suspicion by the prober's next probe)."""
        terminal = kind == Status.DEAD or kind == Status.LEFT
        extra = self.settings.retransmit_limit(self.cluster_size()) if terminal else 0
        self._gossip.push(subject, raw, extra=extra)

    def _reply(self, peer: str, raw: bytes) -> None:
        """Send `peer` a correction: while handling its message, gathered into one reply
        of at most MAX_REPLY_ITEMS distinct items (sent when the message is done)."""
        if self._replies is None:
            self._send(peer, MsgKind.GOSSIP, b"", [raw])
            return
        owed = self._replies.setdefault(peer, {})
        if raw not in owed and len(owed) >= MAX_REPLY_ITEMS:
            self.counters["dropped_replies"] += 1
            return
        owed[raw] = None

    # -------------------------------------------------- push-pull, gossip timers

    def _state_entries(self) -> list[bytes]:
        own = Status.LEFT if self._leaving else Status.ALIVE
        entries = [wire.entry_bytes(own, self._incarnation, self._record)]
        entry = wire.entry_bytes
        for m in self._members.by_id.values():
            accusation = m.accusation
            if m.status in (Status.SUSPECT, Status.DEAD) and accusation is not None:
                # the entry carries the signed statement, whose kind is the status we send
                entries.append(entry(accusation.kind, m.incarnation, m.record, accusation.raw))
            elif m.record:
                entries.append(entry(m.status, m.incarnation, m.record))
        return entries

    def _send_push_pull(self, peer: str, *, reply: bool) -> None:
        self.counters["push_pulls"] += not reply
        self._send(peer, MsgKind.PUSH_PULL, wire.push_pull_body(reply, self._state_entries()))

    def _merge_state(self, sender: str, entries: list[wire.Entry], now: float) -> None:
        """Anti-entropy: take newer records and accusations, and gossip the news
        on (it may come from across a healed partition) - unless we were alone,
        i.e. joining, when the news is ours only and already known to the rest."""
        spread = self._members.live > 0
        for entry in entries:
            record, accusation = entry.record, entry.accusation
            if record.subject == self.peer_id:
                # our own record first: an earlier life's, above the incarnation we
                # restarted at, makes us outbid it, and then its accusation is not ahead
                self._about_me(record, sender, count_stale=False)
                if accusation is not None:
                    self._about_me(accusation, sender, count_stale=False)
                continue
            if entry.status == Status.DEAD and record.subject not in self._members.by_id:
                continue  # do not learn members only to suspect them
            gossip = spread or record.subject == sender
            self._apply_item(record, now, gossip=gossip, count_stale=False)
            if accusation is None:
                continue
            self._apply_item(accusation, now, gossip=False, count_stale=False)

    def _verify_death(self, member: Member, item: Item, now: float) -> None:
        """A death we have no evidence of ourselves may be stale news, e.g. from
        across a partition that just healed. Suspect it (in the declarer's name if
        we did not yet; more declarations do not confirm it) and probe it with the
        accusation attached (a live member refutes); only a failed probe makes it
        dead here."""
        suspicion = member.suspicion
        if suspicion is None:
            self._start_suspicion(member, item, now)
            suspicion = member.suspicion
            assert suspicion is not None
            # tell the subject at once, since our probe may wait for others
            self._send(member.peer_id, MsgKind.GOSSIP, b"", [item.raw])
        self._request_verification(suspicion, now)

    def _believes(self, member: Member) -> bool:
        """Whether we take a death of this member on others' word: only if we
        suspect it ourselves (our own probe failed) or others confirmed the
        suspicion. Declarations alone do not count: after a partition heals, many
        come from the other side at once."""
        suspicion = member.suspicion
        if member.status != Status.SUSPECT or suspicion is None:
            return False
        if member.accusation is not None and member.accusation.kind == Status.DEAD:
            return False  # a death we are verifying already
        if self.peer_id in suspicion.accusers:
            return True
        return suspicion.confirmations >= max(1, suspicion.expected)

    def _verified(self, item: Item) -> bool:
        if self._budget is not None:
            if self._budget <= 0:  # the rest of this message's news waits for a later one
                self.counters["dropped_over_verify_budget"] += 1
                return False
            self._budget -= 1
        if self._verify(item.signer, item.signing_input, item.signature):
            return True
        self.counters["dropped_bad_item_signature"] += 1
        return False

    def _gossip_targets(self, count: int, now: float) -> list[str]:
        # members dead for a short while are included, so a live one wrongly
        # declared dead hears it and refutes
        return self._members.sample(count, dead_since=now - self.settings.gossip_to_dead_s)

    def _on_gossip_timer(self, _key: object, _when: float, now: float) -> None:
        self._timers.add(now + self.settings.gossip_interval_s, _GOSSIP)
        if len(self._gossip):
            for peer in self._gossip_targets(self.settings.gossip_fanout, now):
                if len(self._gossip):
                    self._send(peer, MsgKind.GOSSIP, b"")

    def _on_push_pull_timer(self, _key: object, _when: float, now: float) -> None:
        base = self.settings.push_pull_interval_s
        self._timers.add(now + base, _PUSH_PULL)
        # one sync per scaled period on average, without a burst when n grows fast
        if self._rng.random() * self.settings.push_pull_period(self.cluster_size()) > base:
            return
        peers = self._members.sample(1)
        if peers and not self._leaving:
            self._send_push_pull(peers[0], reply=False)

    def _on_reconnect_timer(self, _key: object, _when: float, now: float) -> None:
        """Forget long-dead members; ping one dead member or seed (an answer
        triggers a push-pull); a member alone syncs with its seeds directly."""
        s = self.settings
        alone = self._members.live == 0
        delay = (
            min(s.reconnect_interval_s, 4 * s.probe_interval_s) if alone else s.reconnect_interval_s
        )
        self._timers.add(now + delay, _RECONNECT)
        for peer in self._members.reap(now - s.dead_retention_s):
            self._replay.forget(peer)
        self._reconnect_pings.clear()
        if self._leaving:
            return
        if alone and self._seeds:
            for seed in self._rng.sample(self._seeds, min(3, len(self._seeds))):
                self._send_push_pull(seed, reply=False)
            return
        members = self._members.by_id
        candidates = self._members.dead() + [p for p in self._seeds if p not in members]
        if candidates:
            peer = self._rng.choice(candidates)
            seq = self._next_probe_seq()
            self._reconnect_pings[seq] = peer
            self._send(peer, MsgKind.PING, wire.probe_body(seq))
