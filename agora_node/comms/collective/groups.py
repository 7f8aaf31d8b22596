"""Group formation without a coordinator: who takes part in an outer round.

A replica of stage k that reaches round t stores a small signed entry under the DHT
key `agora/<run>/outer-v2/<k>/<t>` (subkey: its peer id) and polls that key. The
round's participant list is closed by a rule every peer evaluates the same way,
where q is a strict majority of the replicas the peer expects (`expect`, from
membership; q = 1 when unknown):

    t_open  = the q-th earliest joined_at among the entries (a majority has joined)
    t_close = t_open + window
    participants = entries with joined_at <= t_close

So no single entry decides when a round closes: an entry claiming joined_at = 0 is
one of the q earliest at most, and t_open is still an honest replica's time. Reading
is bounded by local clocks: an entry whose joined_at lies more than `max_skew`
ahead of this peer's clock, or further back than the entries' `ttl` (planted long
ago), is ignored, and at most `max_entries` entries are read. If fewer than q entries
come within `patience` of this peer's own entry (replicas died since membership last
saw them), the round closes on everyone seen (degraded: views may differ).

A peer reads the key until its clock passes t_close + settle (time for stores to
propagate), or until it sees `expect` participants (everyone it knows of), then
partitions the participants (plan.partition) into groups. Peers reading the same
entries compute the same groups; a peer whose view differs ends up in a group the
others do not recognize, is refused by them, and completes the round alone.
A peer that arrives after t_close is alone for this round.

Once its mixes of a round are over (or once its list leaves it alone in every group),
a peer re-stores its entry marked `done`, with a digest of the list it closed
(`Matchmaker.finish`). Peers that expected different replicas close different lists:
a replica that expected only itself closes at once, and a joiner that copied its state
just then, reading the still-fresh entry, formed a group of two with it that the other
never formed, waited on it, and in the next round the same again: both out of step for
up to a minute (bench/late_joiner.py). A peer whose list holds only done entries besides
its own, none of an expected replica on this same list, is alone (`finished_apart`);
any other list stands as before. The mark narrows the race rather than closing it: a
joiner that reads before the mark is stored still waits on that round.
`opened_by_others` counts done entries: the round ran (a replica behind ends its inner
steps, then catches up, rounds.py, or enters the round and is alone in it at once).

A replica still doing inner steps ends its round once q - 1 other replicas have
entered it (`opened_by_others`), which makes it the q-th: one entry alone ends
nobody's round unless the stage has at most three replicas.

An entry also names up to `MAX_FLAGS` peers its author has banned (node/suspects.py:
caught sending outlier or forged values). A peer named by a strict majority of the
closed participants' entries is left out of the round (`excluded`): every peer reading
the same entries leaves out the same peers, so groups stay the same everywhere, and
a minority cannot remove anyone. The excluded peer's own view lacks it: it mixes alone.

Entries are signed with the Ed25519 key the peer id commits to and verified on
read, so nobody can enter a round under another peer's id (entries.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, Protocol

from agora_node.comms.collective.entries import (
    MAX_FLAGS,
    RoundEntry,
    view_digest,
)
from agora_node.comms.collective.plan import group_of, partition, round_seed
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import outer_round_key

log = logging.getLogger(__name__)
KEPT_ENTRIES = 4
"""Own entries a Matchmaker remembers until `finish` marks them done (rounds overlap by one)."""


def excluded(
    entries: Collection[RoundEntry], voters: Collection[str] | None = None
) -> frozenset[str]:
    """Participants named as banned by a strict majority of the entries (each entry one
    vote per peer, its own name not counted). voters: only these peers' entries vote (the
    replicas the reader expects; strangers' entries must not outvote them), the majority
    taken of those present. The same set for everyone who reads the same entries with the
    same voters; replicas whose membership views differ for a moment may disagree, and
    then form groups that do not match for that round (each mixes alone or with fewer)."""
    ballots = [e for e in entries if voters is None or e.peer_id in voters]
    votes: dict[str, int] = {}
    for e in ballots:
        for peer in e.flags:
            if peer != e.peer_id:
                votes[peer] = votes.get(peer, 0) + 1
    present = {e.peer_id for e in entries}
    return frozenset(p for p, n in votes.items() if p in present and 2 * n > len(ballots))


def expected_ids(expect: Expect) -> frozenset[str] | None:
    """The expected replicas' peer ids, when `expect` names them."""
    return None if expect is None or isinstance(expect, int) else frozenset(expect)


Expect = int | Collection[str] | None
"""The replicas a peer expects in a round: their peer ids (membership's live replicas of
the stage, this peer included), or only their number (simulations; then any entries,
a stranger's too, count towards closing early), or None (unknown: quorum 1)."""


def expected_count(expect: Expect) -> int | None:
    return expect if expect is None or isinstance(expect, int) else len(set(expect))


def finished_apart(closed: Collection[RoundEntry], me: str, ids: Collection[str] | None) -> bool:
    """Whether this peer (`me`), having closed the list `closed` on every entry it read,
    is in fact alone in the round: every other member of the list finished the round
    (`done`), and none of the members it expects (`ids`; None: every member) finished on
    this same list. Their groups never held this peer (a replica that did not expect a
    joiner closed without it): it mixes with nobody, at once, instead of waiting on them.

    Otherwise the list stands as every reader of these entries closes it: a done member
    that closed this list finished with this peer in its groups (its results are still
    served), and a member not done, expected or not, may be mixing on it. So a stranger
    cannot move an honest peer's list with its own mark, whatever digest it names; it can
    keep the list as it was before marks existed (an entry not done, or this list's
    digest claimed by one it does not expect does not count)."""
    others = [e for e in closed if e.peer_id != me]
    if not others or not all(e.done for e in others):
        return False
    seen = view_digest(closed)
    return not any(e.view == seen for e in others if ids is None or e.peer_id in ids)


def quorum(expect: Expect) -> int:
    """Entries needed before a round opens: a strict majority of the expected replicas."""
    n = expected_count(expect)
    return 1 if n is None or n <= 1 else n // 2 + 1


def close_view(
    entries: list[RoundEntry],
    *,
    window: float,
    settle: float,
    now: float,
    expect: Expect,
    since: float | None = None,
    patience: float = math.inf,
) -> list[RoundEntry] | None:
    """The closed participant list, or None while it may still grow.

    The round closes early once everyone expected is there: every expected peer id (or,
    given a count, that many entries). since: when this peer entered the round; after
    `patience` more seconds without a quorum, the round closes on every entry seen.
    Given peer ids, only their entries open the round and set its close: others still
    join it within the window, but entries of strangers (free to sign, `joined_at` of
    their choice) cannot close it before the expected replicas are in."""
    if not entries:
        return None
    ids = expected_ids(expect)
    times = sorted(e.joined_at for e in entries if ids is None or e.peer_id in ids)
    q = quorum(expect)
    if len(times) < q:
        if since is not None and now >= since + patience:
            return sorted(entries, key=lambda e: e.peer_id)
        return None
    t_close = times[q - 1] + window
    members = sorted((e for e in entries if e.joined_at <= t_close), key=lambda e: e.peer_id)
    if isinstance(expect, int):
        everyone = len(members) >= expect
    else:
        everyone = expect is not None and set(expect) <= {e.peer_id for e in members}
    if everyone:
        return members
    return members if now >= t_close + settle else None


def fresh(entry: RoundEntry, *, now: float, ttl: float, max_skew: float) -> bool:
    """Could this entry have been written by an honest peer with a clock near ours?"""
    return now - ttl - max_skew <= entry.joined_at <= now + max_skew


@dataclass(frozen=True)
class RoundView:
    """The closed participants of one round, as this peer saw them."""

    run_id: str
    stage: int
    round: int
    me: str
    entries: tuple[RoundEntry, ...]
    excluded: tuple[str, ...] = ()
    """Participants left out because a majority of the entries named them (`excluded`)."""

    @property
    def peers(self) -> list[str]:
        return [e.peer_id for e in self.entries]

    def group(self, phase: str, group_size: int) -> tuple[str, ...]:
        """My group for `phase`; each phase is partitioned with its own seed."""
        if self.me not in self.peers:
            return (self.me,)
        seed = round_seed(self.run_id, self.stage, self.round, phase, self.peers)
        return group_of(partition(self.peers, group_size, seed), self.me)

    def entry(self, peer: str) -> RoundEntry | None:
        return next((e for e in self.entries if e.peer_id == peer), None)


class Board(Protocol):
    """Where round entries are published and read (a DHT, or memory in simulations)."""

    async def publish(self, key: str, subkey: str, value: Any, expiration: float) -> bool: ...

    async def read(self, key: str) -> dict[str, Any]: ...


@dataclass(frozen=True, kw_only=True)
class MatchmakingConfig:
    window: float = 5.0
    """Seconds after the first entry of a round during which others may still join it."""
    settle: float = 1.0
    poll_interval: float = 0.25
    ttl: float = 60.0
    """How long entries live in the DHT; older joined_at values are ignored on read."""
    max_skew: float = 2.0
    """Clock skew tolerated between peers: entries further in the future are ignored."""
    patience: float | None = None
    """Seconds to wait for a quorum before closing on whoever came (default 4 windows)."""
    max_entries: int = 256
    """Entries read per round at most (a bounded view, whatever is stored)."""

    def waited(self) -> float:
        return 4 * self.window + self.settle if self.patience is None else self.patience


class Matchmaker:
    def __init__(
        self,
        board: Board,
        identity: Identity,
        *,
        run_id: str,
        stage: int,
        config: MatchmakingConfig,
        admit: Callable[[str], bool] | None = None,
    ) -> None:
        self.board, self.identity = board, identity
        self.run_id, self.stage, self.config = run_id, stage, config
        self.admit = admit
        """A private swarm's allow list: entries of other signers are dropped (and counted
        by `admit`) before the `max_entries` bound, so strangers cannot crowd listed peers out."""
        self.ignored = 0
        self._entered: dict[int, tuple[RoundEntry, str]] = {}
        """This peer's entries of its last rounds and the digests of the lists it closed
        them with, until `finish` marks them done."""
        self._marks: set[asyncio.Task[None]] = set()
        """Stores of `finish_soon` under way."""

    async def gather(
        self,
        round_no: int,
        *,
        digest: str = "",
        warming: bool = False,
        expect: Expect = None,
        flags: Collection[str] = (),
    ) -> RoundView:
        """Enter round `round_no` and return its closed view, less the peers a majority
        of the entries name in their `flags` (this peer names `flags`)."""
        me = RoundEntry(
            peer_id=self.identity.peer_id,
            run_id=self.run_id,
            stage=self.stage,
            round=round_no,
            joined_at=time.time(),
            digest=digest,
            warming=warming,
            flags=tuple(flags)[:MAX_FLAGS],
        )
        key = outer_round_key(self.run_id, self.stage, round_no)
        cfg = self.config
        if not await self._publish(key, me):
            log.warning("could not publish round %d entry: mixing alone", round_no)
            return RoundView(self.run_id, self.stage, round_no, me.peer_id, (me,))
        # A round's list closes by this at the latest: a peer re-storing its entry with a
        # later joined_at (within max_skew) kept moving the close, round after round.
        last_close = me.joined_at + cfg.waited() + 2 * (cfg.window + cfg.settle) + cfg.max_skew
        entries = {me.peer_id: me}
        while True:
            ids = expected_ids(expect)
            for entry in await self._read(key, round_no):
                first = entries.get(entry.peer_id)
                expected = ids is not None and entry.peer_id in ids
                if first is None and len(entries) > cfg.max_entries and not expected:
                    continue  # bounded across polls too; an expected replica still gets in
                # a peer's joined_at is the first one read: only its done mark replaces it
                if first is None or entry.joined_at == first.joined_at:
                    entries[entry.peer_id] = entry
            entries[me.peer_id] = me
            now = time.time()
            closed = close_view(
                list(entries.values()),
                window=cfg.window,
                settle=cfg.settle,
                now=now,
                expect=expect,
                since=me.joined_at,
                patience=cfg.waited(),
            )
            if closed is None and now >= last_close:
                log.warning("round %d: no list closed in time: closing on whoever came", round_no)
                closed = sorted(entries.values(), key=lambda e: e.peer_id)
            if closed is not None and finished_apart(closed, me.peer_id, expected_ids(expect)):
                closed = [me]  # the others finished without this peer: alone
            if closed is not None:
                self._entered[round_no] = (me, view_digest(closed))
                for old in sorted(self._entered)[:-KEPT_ENTRIES]:
                    del self._entered[old]
                out = excluded(closed, expected_ids(expect))
                if out:
                    log.info(
                        "round %d leaves out %s (a majority banned them)", round_no, sorted(out)
                    )
                kept = tuple(e for e in closed if e.peer_id not in out)
                return RoundView(
                    self.run_id, self.stage, round_no, me.peer_id, kept, tuple(sorted(out))
                )
            await asyncio.sleep(cfg.poll_interval)

    async def finish(self, round_no: int) -> bool:
        """Mark this peer's entry of `round_no` done (its mixes of the round are over), with
        the digest of the list it closed: a peer that reaches the round later (a joiner that
        copied this one's state, or one that lagged) then forms no group with this peer
        that this peer never formed (`gather`, `finished_apart`). One store, living `ttl`
        from now (later than the entry's, so it replaces it); whether stored."""
        entered = self._entered.pop(round_no, None)
        if entered is None:  # never entered (mixed alone, or skipped the round catching up)
            return False
        me, seen = entered
        key = outer_round_key(self.run_id, self.stage, round_no)
        marked = replace(me, done=True, view=seen)
        expiration = time.time() + self.config.ttl
        stored = await self.board.publish(key, me.peer_id, marked.sign(self.identity), expiration)
        if not stored:  # a late reader then waits on this peer, as before marks existed
            log.debug("round %d: the entry marked done was not stored", round_no)
        return stored

    def finish_soon(self, round_no: int) -> None:
        """`finish` in the background: the round does not wait on the DHT (a second call
        for the round stores nothing). A failure leaves late readers waiting on this peer,
        as before marks existed."""

        async def mark() -> None:
            try:
                await self.finish(round_no)
            except Exception as exc:
                log.warning("round %d: could not mark the round entry done: %r", round_no, exc)

        task = asyncio.create_task(mark())
        self._marks.add(task)
        task.add_done_callback(self._marks.discard)

    async def close(self) -> None:
        """Cancel the marks still being stored (a leaving peer's last one is lost)."""
        marks = list(self._marks)
        for task in marks:
            task.cancel()
        await asyncio.gather(*marks, return_exceptions=True)

    async def _publish(self, key: str, me: RoundEntry) -> bool:
        """Store my entry; a store the DHT refused or lost under load is retried until the
        round's window has passed (one transient failure must not cost the round)."""
        cfg, signed = self.config, me.sign(self.identity)
        deadline = me.joined_at + cfg.window
        while True:
            if await self.board.publish(key, me.peer_id, signed, time.time() + cfg.ttl):
                return True
            if time.time() + cfg.poll_interval >= deadline:
                return False
            await asyncio.sleep(cfg.poll_interval)

    async def opened_by_others(
        self, round_no: int, expect: Expect = None, ignore: Collection[str] = ()
    ) -> bool:
        """Have enough other peers entered round `round_no` (verified, fresh entries) that
        this one joining completes a quorum? One other is enough when `expect` is unknown.
        Entries of `ignore` (peers this one banned) do not count, nor, when `expect` names
        the replicas, anyone else's."""
        key = outer_round_key(self.run_id, self.stage, round_no)
        skip, ids = {self.identity.peer_id, *ignore}, expected_ids(expect)
        others = [
            e
            for e in await self._read(key, round_no)
            if e.peer_id not in skip and (ids is None or e.peer_id in ids)
        ]
        return len(others) >= max(1, quorum(expect) - 1)

    async def _read(self, key: str, round_no: int) -> list[RoundEntry]:
        out = []
        cfg, now = self.config, time.time()
        stored = await self.board.read(key)
        if self.admit is not None:  # the signature binds the entry to its subkey (verified)
            stored = {p: v for p, v in stored.items() if self.admit(str(p))}
        for peer, value in list(stored.items())[: cfg.max_entries]:
            try:
                entry = RoundEntry.verified(
                    value, peer_id=peer, run_id=self.run_id, stage=self.stage, round_no=round_no
                )
            except Exception as exc:  # noqa: BLE001 - a stranger's bytes: never stop the round
                self.ignored += 1
                log.debug("ignored round entry under %s: %s", str(peer)[:16], exc)
                continue
            if not fresh(entry, now=now, ttl=cfg.ttl, max_skew=cfg.max_skew):
                self.ignored += 1
                log.debug("ignored round entry of %s: joined_at out of range", peer[:16])
                continue
            out.append(entry)
        return out


class MemoryBoard:
    """A Board in memory, shared by simulated replicas of one process."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, Any]] = {}

    async def publish(self, key: str, subkey: str, value: Any, expiration: float) -> bool:
        self.data.setdefault(key, {})[subkey] = value
        return True

    async def read(self, key: str) -> dict[str, Any]:
        return dict(self.data.get(key, {}))


class DHTBoard:
    """A Board over hivemind.DHT, every call bounded (a stuck DHT must not stall a round)."""

    def __init__(self, dht: Any, *, timeout: float = 10.0) -> None:
        self.dht, self.timeout = dht, timeout

    async def publish(self, key: str, subkey: str, value: Any, expiration: float) -> bool:
        future = self.dht.store(key, value, expiration, subkey=subkey, return_future=True)
        try:
            return bool(await asyncio.wait_for(future, self.timeout))
        except (TimeoutError, Exception) as exc:  # noqa: BLE001 - any DHT failure = not stored
            log.warning("DHT store of %s failed: %r", key, exc)
            return False

    async def read(self, key: str) -> dict[str, Any]:
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            found = await asyncio.wait_for(future, self.timeout)
        except (TimeoutError, Exception) as exc:  # noqa: BLE001
            log.warning("DHT get of %s failed: %r", key, exc)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(sub): item.value for sub, item in found.value.items()}
