"""Admission to a private swarm: refusing unlisted peers, and learning that we are one.

A node started with `--allow-keys` refuses what unlisted peers send, by the peer id
libp2p or a signature authenticates (records, round entries, streams, RPCs, SWIM).
A refused stream gets one `KIND_REFUSED` frame before its request is read
(streams.serve), so an unlisted peer learns why at once instead of retrying.

A joiner asks the peers it sees in the directory whether they admit it
(`ask`, over `admission_protocol`): an unlisted node stops with the refusal's
one line instead of waiting at step 0 for a pipeline that never answers. Refusals
are not counted against admissions: in an open swarm a stranger can publish as
many records as it likes and answer "refused" from each, so outnumbering proves
nothing. `Admission` decides: the node is refused only when every peer it sees has
answered, at least one refused, and none admitted it (a peer that gave no answer
may be an honest one kept busy). A stranger cannot stop a joiner that any honest
peer admits. An admitted node asks again every minute, so one removed from every
list while running stops too; but only on the refusal of a peer that admitted it
before, so strangers alone never stop a running node.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hivemind.p2p import P2P

from agora_node.comms import streams
from agora_node.comms.guard import ADMISSION
from agora_node.protocol.allowlist import AllowList, refusal_message
from agora_node.protocol.names import admission_protocol

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 3.0
ADMITTED = b"admitted"

Refuse = Callable[[str], str | None]
"""remote peer id -> a one-line refusal, or None to serve it."""


def refuser(allow: AllowList | None, me: str, what: str) -> Refuse | None:
    """The `refuse` of a stream protocol: None (open swarm), or refuse unlisted peers,
    counting each refusal under `what`."""
    if allow is None:
        return None

    def refuse(remote: str) -> str | None:
        return None if allow.check(remote, what) else refusal_message(remote, me)

    return refuse


def record_holders_only(
    refuse: Refuse | None, known: Callable[[str], bool], on_unknown: Callable[[str], None]
) -> Refuse:
    """`refuse`'s refusal (a private swarm's allow list, or None), then one of the peers
    `known` does not name (no record at this node's stage, read lately), before anything
    of their request is read; each of those is told to `on_unknown(peer)` (counted as
    `no_record`). Who may ask a replica for its state, or send it the collective's whole
    requests through a relay: a stranger's requests would hold its few slots or memory."""

    def check(remote: str) -> str | None:
        refusal = refuse(remote) if refuse is not None else None
        if refusal is None and not known(remote):
            on_unknown(remote)
            refusal = f"no record of {remote[-8:]} at this node's stage: announce a record first"
        return refusal

    return check


async def serve_admission(p2p: P2P, run_id: str, refuse: Refuse | None) -> None:
    """Answer "admitted" to listed peers (everyone in an open swarm); the rest are refused."""

    async def handler(remote: str, request: bytes) -> AsyncIterator[bytes]:
        yield ADMITTED

    await streams.serve(p2p, admission_protocol(run_id), handler, max_request=64, refuse=refuse)


class Verdict(enum.Enum):
    ADMITTED = "admitted"
    REFUSED = "refused"
    UNKNOWN = "unknown"
    """No answer (gone, slow, or a version without the protocol): counts for nothing."""
    BUSY = "busy"
    """Its guard turned the ask away (busy, rate): alive, with the protocol; counts for
    nothing, and is no silence (a stranger can keep an honest peer's guard busy)."""


async def ask(
    p2p: P2P, run_id: str, peer: str, timeout: float = ASK_TIMEOUT_S
) -> tuple[Verdict, str]:
    """Does `peer` admit us? The verdict and, when refused, its one-line reason."""
    try:
        answer = await streams.request(
            p2p, peer, admission_protocol(run_id), b"", timeout=timeout, max_response=2048
        )
    except streams.RefusedError as exc:
        return Verdict.REFUSED, str(exc)
    except streams.StreamError as exc:
        log.debug("admission: no answer from %s: %s", peer[-8:], exc)
        turned_away = any(f"refused ({r.value})" in str(exc) for r in ADMISSION)
        return (Verdict.BUSY if turned_away else Verdict.UNKNOWN), ""
    return (Verdict.ADMITTED if answer == ADMITTED else Verdict.UNKNOWN), ""


MAX_ADMITTERS = 64
SILENT_ASKS = 10
"""Asks without an answer after which a peer counts as absent for a node never admitted
(a silent peer is asked again at every refresh: half a minute or more)."""

RECHECK_S = 60.0
"""An admitted node asks again this often: one removed from the lists learns it too."""


@dataclass
class Admission:
    """What the peers asked said (pure bookkeeping; the node does the asking)."""

    recheck_s: float = RECHECK_S
    seen: set[str] = field(default_factory=set)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    asked_at: dict[str, float] = field(default_factory=dict)
    silent: dict[str, int] = field(default_factory=dict)
    """Peers that gave no answer, by how many times in a row."""
    admitted_by: dict[str, None] = field(default_factory=dict)
    """Peers that admitted us, even after they left the directory (the newest
    MAX_ADMITTERS): once there is one, only a refusal of one of them stops us."""

    def to_ask(self, peers: list[str], now: float, limit: int = 8) -> list[str]:
        """Of `peers` (the directory's now), those never asked, without an answer, or
        asked `recheck_s` ago (at most `limit`). Peers no longer seen are forgotten."""
        seen = self.seen = set(peers)
        for gone in set(self.verdicts) - seen:
            self.verdicts.pop(gone)
            self.reasons.pop(gone, None)
            self.asked_at.pop(gone, None)
            self.silent.pop(gone, None)
        due = [
            p
            for p in seen
            if self.verdicts.get(p, Verdict.UNKNOWN) in (Verdict.UNKNOWN, Verdict.BUSY)
            or now - self.asked_at.get(p, now) >= self.recheck_s
        ]
        # never asked first, then the longest ago: peers that never answer cannot starve others
        return sorted(due, key=lambda p: (self.asked_at.get(p, -math.inf), p))[:limit]

    def note(self, peer: str, verdict: Verdict, reason: str, now: float) -> None:
        self.verdicts[peer], self.asked_at[peer] = verdict, now
        if verdict == Verdict.UNKNOWN:
            self.silent[peer] = self.silent.get(peer, 0) + 1
        else:
            self.silent.pop(peer, None)
        if verdict == Verdict.REFUSED:
            self.reasons[peer] = reason
        else:
            self.reasons.pop(peer, None)
        if verdict == Verdict.ADMITTED:
            self.admitted_by.pop(peer, None)
            self.admitted_by[peer] = None  # newest last
            while len(self.admitted_by) > MAX_ADMITTERS:
                del self.admitted_by[next(iter(self.admitted_by))]

    def refusal(self) -> str | None:
        """The line to stop with, or None. Only once every peer seen has answered (one
        turned away busy may be an honest peer a stranger keeps busy; one silent
        SILENT_ASKS times in a row counts as absent for a node never admitted), none
        admitted us and some refused; and once a peer has admitted us, only when one that
        did now refuses (a stranger with a fresh key refuses as easily as it publishes a
        record: in an open swarm it made running nodes quit)."""
        # a peer silent SILENT_ASKS times in a row (an older version, one we cannot dial)
        # counts as absent for a node never admitted: it would otherwise wait for ever.
        # A busy answer is no silence: a stranger could keep honest peers' guards busy
        absent = set() if self.admitted_by else {
            p for p, n in self.silent.items() if n >= SILENT_ASKS
        }  # fmt: skip
        verdicts = {self.verdicts.get(p, Verdict.UNKNOWN) for p in self.seen - absent}
        if verdicts & {Verdict.ADMITTED, Verdict.UNKNOWN, Verdict.BUSY}:
            return None
        refusers = sorted(p for p in self.seen if self.verdicts[p] == Verdict.REFUSED)
        if self.admitted_by:
            refusers = [p for p in refusers if p in self.admitted_by]
        return self.reasons[refusers[0]] if refusers else None


async def ask_all(
    p2p: P2P, run_id: str, peers: list[str], admission: Admission, now: float
) -> str | None:
    """Ask `peers` at once, note the answers; the refusal to stop with, if any."""
    verdicts = await asyncio.gather(*(ask(p2p, run_id, peer) for peer in peers))
    for peer, (verdict, reason) in zip(peers, verdicts, strict=True):
        admission.note(peer, verdict, reason, now)
    return admission.refusal()
