"""Admission to a private swarm: refusing unlisted peers, and learning that we are one.

A node started with `--allow-keys` refuses what unlisted peers send, by the peer id
libp2p or a signature authenticates (records, round entries, streams, RPCs, SWIM).
A refused stream gets one `KIND_REFUSED` frame before its request is read
(streams.serve), so an unlisted peer learns why at once instead of retrying.

A joiner asks the peers it sees in the directory whether they admit it
(`ask`, over `admission_protocol`): an unlisted node stops with the refusal's
one line instead of waiting at step 0 for a pipeline that never answers. One
refusal alone is not believed: in an open swarm a stranger could answer "refused"
to every joiner. `Admission` decides: the node is refused once the peers that
refused it outnumber those that admitted it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hivemind.p2p import P2P

from agora_node.comms import streams
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
        return Verdict.UNKNOWN, ""
    return (Verdict.ADMITTED if answer == ADMITTED else Verdict.UNKNOWN), ""


@dataclass
class Admission:
    """What the peers asked so far said (pure bookkeeping; the node does the asking)."""

    verdicts: dict[str, Verdict] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def to_ask(self, peers: list[str], limit: int = 8) -> list[str]:
        """Peers not asked yet, or that did not answer (at most `limit`)."""
        fresh = [p for p in peers if self.verdicts.get(p, Verdict.UNKNOWN) == Verdict.UNKNOWN]
        return sorted(set(fresh))[:limit]

    def note(self, peer: str, verdict: Verdict, reason: str = "") -> None:
        self.verdicts[peer] = verdict
        if reason:
            self.reasons[peer] = reason

    def refusal(self) -> str | None:
        """The line to stop with once refusals outnumber admissions, else None."""
        counts = {v: 0 for v in Verdict}
        for verdict in self.verdicts.values():
            counts[verdict] += 1
        if counts[Verdict.REFUSED] == 0 or counts[Verdict.REFUSED] <= counts[Verdict.ADMITTED]:
            return None
        return next(iter(self.reasons.values()))


async def ask_all(p2p: P2P, run_id: str, peers: list[str], admission: Admission) -> str | None:
    """Ask `peers` at once, note the answers; the refusal to stop with, if any."""
    verdicts = await asyncio.gather(*(ask(p2p, run_id, peer) for peer in peers))
    for peer, (verdict, reason) in zip(peers, verdicts, strict=True):
        admission.note(peer, verdict, reason)
    return admission.refusal()
