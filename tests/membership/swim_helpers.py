"""Helpers shared by the membership tests: simulated clusters and hand-made messages."""

from __future__ import annotations

from agora_node.comms.membership import messages as wire
from agora_node.comms.membership.messages import MemberMeta, MsgKind, Status
from agora_node.comms.membership.settings import MembershipSettings
from agora_node.comms.membership.simnet import LinkModel, SimNetwork
from agora_node.comms.membership.swim import Membership
from agora_node.protocol.identity import Identity

FAST = MembershipSettings(
    probe_interval_s=0.5,
    probe_timeout_s=0.2,
    indirect_timeout_s=0.3,
    reconnect_interval_s=2.0,
)


def cluster(
    n: int,
    *,
    loss: float = 0.0,
    seed: int = 0,
    settings: MembershipSettings = FAST,
    rtt_s: float = 0.02,
) -> SimNetwork:
    net = SimNetwork(
        settings=settings, link=LinkModel(rtt_s=rtt_s, jitter_s=rtt_s / 4, loss=loss), seed=seed
    )
    net.add_converged(n)
    return net


def status_at(net: SimNetwork, observer: str, subject: str) -> Status | None:
    view = net.node(observer).get(subject)
    return None if view is None else view.status


def everyone_sees(
    net: SimNetwork, subject: str, status: Status, skip: set[str] = frozenset()
) -> bool:
    return all(
        status_at(net, peer, subject) == status
        for j, peer in enumerate(net.ids)
        if peer != subject and peer not in skip and not net.crashed[j]
    )


def dead_events(net: SimNetwork) -> list[tuple[float, str, str]]:
    return [(t, obs, v.peer_id) for t, obs, v in net.events if v.status == Status.DEAD]


def item(signer: Identity, kind: Status, subject: str, inc: int, **kw: object) -> bytes:
    """A gossip item signed by `signer` (the subject for ALIVE/LEFT, else the accuser)."""
    accuser = signer.peer_id if kind in (Status.SUSPECT, Status.DEAD) else None
    body = wire.item_body(kind, subject, inc, accuser=accuser, **kw)  # type: ignore[arg-type]
    return body + signer.sign(wire.ITEM_DOMAIN + body)


def message(
    signer: Identity,
    to: str,
    kind: MsgKind,
    seq: int,
    body: bytes = b"",
    items: list[bytes] | None = None,
    *,
    signed: bool = True,
) -> bytes:
    """An envelope from `signer` to `to`, signed like a real member would."""
    unsigned = wire.encode_envelope(kind, seq, body, items or [], signed=signed)
    if not signed:
        return unsigned
    return unsigned + signer.sign(wire.envelope_signing_input(signer.peer_id, to, unsigned))


class Wire:
    """A transport that records what a lone machine sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def __call__(self, to: str, data: bytes) -> None:
        self.sent.append((to, data))

    def kinds_to(self, peer: str) -> list[MsgKind]:
        return [wire.decode_envelope(d).kind for t, d in self.sent if t == peer]


def lone_machine(identity: Identity, **kw: object) -> tuple[Membership, Wire]:
    """A real-signature machine at time 0 whose transport only records."""
    import random

    from agora_node.comms.membership.signing import Ed25519Verifier

    out = Wire()
    machine = Membership(
        identity,
        Ed25519Verifier(),
        send=out,
        rng=random.Random(0),
        now=0.0,
        settings=kw.pop("settings", FAST),  # type: ignore[arg-type]
        meta=MemberMeta(stage=0, state="active"),
        **kw,  # type: ignore[arg-type]
    )
    return machine, out
