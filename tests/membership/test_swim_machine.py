"""The SWIM/Lifeguard state machine on a simulated network (simulated time: fast)."""

from __future__ import annotations

import pytest
from swim_helpers import (
    FAST,
    cluster,
    dead_events,
    everyone_sees,
    item,
    lone_machine,
    message,
    status_at,
)

from agora_node.comms.membership import messages as wire
from agora_node.comms.membership.messages import MemberMeta, MsgKind, Status
from agora_node.protocol.identity import Identity

pytestmark = pytest.mark.timeout(60)


def test_crash_is_detected_by_every_member_within_the_bound() -> None:
    net = cluster(10)
    net.run_until(3.0)
    victim = net.ids[3]
    net.crash(victim)
    bound = FAST.detection_bound_s(10)
    assert net.run_while(lambda: not everyone_sees(net, victim, Status.DEAD), 3.0 + bound)
    assert {peer for _, _, peer in dead_events(net)} == {victim}
    suspected = [t for t, _, v in net.events if v.peer_id == victim and v.status == Status.SUSPECT]
    assert suspected and min(suspected) < min(t for t, _, _ in dead_events(net))


def test_suspected_member_refutes_and_stays_alive() -> None:
    net = cluster(8)
    net.run_until(2.0)
    subject, observer = net.ids[2], net.ids[5]
    mallory = Identity.generate()
    accusation = item(mallory, Status.SUSPECT, subject, 0)
    gossip = message(mallory, observer, MsgKind.GOSSIP, 1, items=[accusation])
    net.inject(observer, mallory.peer_id, gossip)
    net.run_until(net.now + 0.01)
    assert status_at(net, observer, subject) == Status.SUSPECT
    assert net.run_while(lambda: net.node(subject).incarnation == 0, net.now + 5.0)
    assert net.run_while(lambda: not everyone_sees(net, subject, Status.ALIVE), net.now + 10.0)
    net.run_until(net.now + 2 * FAST.suspicion_bounds(8)[1])
    assert dead_events(net) == []


class _Responder:
    """Answers the lone machine's pings on behalf of every peer but `silent`."""

    def __init__(self, machine, out, peers: list[Identity], silent: str) -> None:
        self.machine, self.out, self.silent = machine, out, silent
        self.peers = {p.peer_id: p for p in peers}
        self.seq = 0
        self.now = 0.0

    def run(self, until: float, step: float = 0.01) -> None:
        while self.now < until:
            self.now = min(until, self.now + step)
            self.machine.tick(self.now)
            self._answer(self.now)

    def _answer(self, now: float) -> None:
        sent, self.out.sent = self.out.sent, []
        for to, data in sent:
            env = wire.decode_envelope(data)
            if env.kind != MsgKind.PING or to == self.silent or to not in self.peers:
                continue
            self.seq += 1
            ack = message(self.peers[to], self.machine.peer_id, MsgKind.ACK, self.seq,
                          wire.probe_body(env.probe_seq))  # fmt: skip
            self.machine.on_message(to, ack, now)


def _accused_by(count: int) -> tuple[float, float, float | None]:
    """A lone machine knows 6 peers; `count` of them accuse a silent one at t=1.
    Returns (low, high, time it was declared dead or None)."""
    me, peers = Identity.generate(), [Identity.generate() for _ in range(6)]
    machine, out = lone_machine(me)
    records = [item(p, Status.ALIVE, p.peer_id, 0, meta=MemberMeta()) for p in peers]
    machine.learn(records, 0.0)
    low, high = FAST.suspicion_bounds(machine.cluster_size())
    subject = peers[0].peer_id
    responder = _Responder(machine, out, peers, silent="")
    responder.run(1.0)
    accusers = peers[1 : 1 + count]
    # confirmations count from members that answered this machine's own probes (or that
    # have been members for a while, which these are not yet)
    while any(machine._members.get(a.peer_id).rtt() is None for a in accusers):
        assert responder.now < 30.0, "the machine never probed every accuser"
        responder.run(responder.now + 0.1)
    start = responder.now
    responder.silent = subject  # it crashes now; the accusations are right
    for k, accuser in enumerate(accusers):
        accusation = item(accuser, Status.SUSPECT, subject, 0)
        gossip = message(accuser, me.peer_id, MsgKind.GOSSIP, 10**6 + k, items=[accusation])
        machine.on_message(accuser.peer_id, gossip, start)
    assert machine.get(subject).status == Status.SUSPECT
    t = start
    while t < start + high + 2.0:
        responder.run(t + 0.01)
        t = responder.now
        if machine.get(subject).status == Status.DEAD:
            return low, high, t - start
    return low, high, None


def test_independent_confirmations_shrink_the_suspicion_timeout() -> None:
    low, high, confirmed = _accused_by(count=4)  # the first accuser + 3 confirmations
    assert confirmed is not None and confirmed == pytest.approx(low, abs=0.02)
    low, high, single = _accused_by(count=1)
    assert single is not None and single > (low + high) / 2


def test_graceful_leave_is_not_a_failure() -> None:
    net = cluster(10)
    net.run_until(2.0)
    leaver, victim = net.ids[1], net.ids[2]
    net.node(leaver).leave(net.now)
    net.crash(victim)
    net.run_until(net.now + 1.0)
    net.crash(leaver)  # gone after a short linger, like the daemon

    def done() -> bool:
        return everyone_sees(net, leaver, Status.LEFT) and everyone_sees(net, victim, Status.DEAD)

    assert net.run_while(lambda: not done(), net.now + FAST.detection_bound_s(10))
    net.run_until(net.now + 10.0)
    assert everyone_sees(net, leaver, Status.LEFT)
    assert {peer for _, _, peer in dead_events(net)} == {victim}


def _sides_see_each_other(net, a: list[str], b: list[str], status: Status) -> bool:
    return all(status_at(net, x, y) == status for x in a for y in b) and all(
        status_at(net, y, x) == status for x in a for y in b
    )


def test_partition_is_detected_and_heals() -> None:
    net = cluster(12, seed=3)
    net.run_until(2.0)
    a, b = net.ids[:6], net.ids[6:]
    net.partition([b])
    assert net.run_while(lambda: not _sides_see_each_other(net, a, b, Status.DEAD), 40.0)
    net.heal()
    healed_at = net.now

    def all_alive() -> bool:
        return all(everyone_sees(net, p, Status.ALIVE) for p in net.ids)

    assert net.run_while(lambda: not all_alive(), net.now + 60)
    # healing works by refutation: nobody is newly declared dead on the way
    assert [e for e in dead_events(net) if e[0] > healed_at] == []


def test_partition_heals_through_seeds_after_the_dead_are_forgotten() -> None:
    settings = FAST.with_overrides(dead_retention_s=5.0)
    net = cluster(10, seed=4, settings=settings)
    seeds = [net.ids[0], net.ids[5]]
    for node in net.nodes:
        node.join(seeds, net.now)
    net.run_until(2.0)
    a, b = net.ids[:5], net.ids[5:]
    net.partition([b])
    forgotten = lambda: all(net.node(x).get(y) is None for x in a for y in b)  # noqa: E731
    assert net.run_while(lambda: not forgotten(), 60.0)
    net.heal()
    assert net.run_while(lambda: not _sides_see_each_other(net, a, b, Status.ALIVE), net.now + 60)


def test_slow_member_is_not_declared_dead_and_backs_off() -> None:
    net = cluster(10, seed=1)
    net.run_until(2.0)
    slow = net.ids[4]
    net.set_slow(slow, 1.0)  # handles messages and timers up to 1 s late
    awareness = 0
    while net.now < 90.0:
        net.run_until(net.now + 0.5)
        awareness = max(awareness, net.node(slow).awareness.score)
    assert dead_events(net) == []  # neither it nor anyone it probes is declared dead
    assert net.node(slow).counters["refutations"] > 0  # it was suspected and answered
    assert awareness > 0  # and its local-health multiplier stretched its timeouts


def test_dead_member_is_not_resurrected_by_stale_news() -> None:
    net = cluster(6)
    net.run_until(2.0)
    victim, observer = net.ids[1], net.ids[2]
    old_record = net.node(victim).record
    net.crash(victim)
    assert net.run_while(lambda: not everyone_sees(net, victim, Status.DEAD), 40.0)
    mallory = Identity.generate()
    replayed = message(mallory, observer, MsgKind.GOSSIP, 1, items=[old_record])
    stale_before = net.node(observer).counters["stale_items"]
    net.inject(observer, mallory.peer_id, replayed)
    net.run_until(net.now + 5.0)
    assert status_at(net, observer, victim) == Status.DEAD
    assert net.node(observer).counters["stale_items"] > stale_before


def test_metadata_change_reaches_everyone() -> None:
    net = cluster(10)
    net.run_until(2.0)
    peer = net.ids[7]
    net.node(peer).update_meta(MemberMeta(stage=2, state="active"), net.now)

    def seen() -> bool:
        views = [net.node(o).get(peer) for o in net.ids if o != peer]
        return all(v is not None and v.meta == MemberMeta(stage=2, state="active") for v in views)

    assert net.run_while(lambda: not seen(), net.now + 10.0)


def test_new_member_joins_through_a_seed() -> None:
    net = cluster(6)
    net.run_until(2.0)
    newcomer = net.add_node(meta=MemberMeta(stage=1, state="warming"))
    newcomer.join([net.ids[0]], net.now)
    assert net.run_while(lambda: not everyone_sees(net, newcomer.peer_id, Status.ALIVE), 20.0)
    assert net.run_while(lambda: len(newcomer.alive_members()) < 6, 20.0)
    assert net.node(net.ids[3]).get(newcomer.peer_id).meta.state == "warming"


def test_probes_measure_each_members_round_trip_in_a_cluster() -> None:
    net = cluster(6, rtt_s=0.08)
    net.run_until(15.0)
    rtts = [net.node(a).rtt(b) for a in net.ids for b in net.ids if a != b]
    measured = [r for r in rtts if r is not None]
    assert len(measured) >= len(rtts) * 3 // 4  # every member is probed every ~2.5 s
    # the least of a few probes: the link's 80 ms plus a little of the simulated jitter
    assert all(0.08 <= r < 0.1 for r in measured), measured


class _SlowResponder:
    """Acks each ping `delay` seconds after it was sent; with `drop_first`, only a probe's
    second ping (the retry after its timeout) is answered."""

    def __init__(self, machine, out, peer: Identity, delay: float, drop_first: bool) -> None:
        self.machine, self.out, self.peer = machine, out, peer
        self.delay, self.drop_first = delay, drop_first
        self.pending: list[tuple[float, int]] = []
        self.seen: set[int] = set()
        self.seq, self.now = 0, 0.0

    def run(self, until: float, step: float = 0.005) -> None:
        while self.now < until:
            self.now = min(until, self.now + step)
            self.machine.tick(self.now)
            sent, self.out.sent = self.out.sent, []
            for _to, data in sent:
                env = wire.decode_envelope(data)
                if env.kind != MsgKind.PING:
                    continue
                first = env.probe_seq not in self.seen
                self.seen.add(env.probe_seq)
                if not (first and self.drop_first):
                    self.pending.append((self.now + self.delay, env.probe_seq))
            due = [p for p in self.pending if p[0] <= self.now]
            self.pending = [p for p in self.pending if p[0] > self.now]
            for _, probe_seq in due:
                self.seq += 1
                ack = message(self.peer, self.machine.peer_id, MsgKind.ACK, self.seq,
                              wire.probe_body(probe_seq))  # fmt: skip
                self.machine.on_message(self.peer.peer_id, ack, self.now)


@pytest.mark.parametrize("drop_first", [False, True])
def test_a_round_trip_is_taken_only_from_a_first_ping_answered_directly(drop_first) -> None:
    me, peer = Identity.generate(), Identity.generate()
    machine, out = lone_machine(me)
    machine.learn([item(peer, Status.ALIVE, peer.peer_id, 0, meta=MemberMeta())], 0.0)
    responder = _SlowResponder(machine, out, peer, delay=0.05, drop_first=drop_first)
    responder.run(3.0)
    assert machine.get(peer.peer_id).status == Status.ALIVE  # every probe was answered
    if drop_first:  # answered after the timeout: a retry's time says nothing of the link
        assert machine.rtt(peer.peer_id) is None
    else:
        assert machine.rtt(peer.peer_id) == pytest.approx(0.05, abs=0.006)
    # either way it answered itself: a host runs behind the id (placement, catch-up and
    # heads count only such peers; one always answering late never counted)
    assert machine.get(peer.peer_id).acked
