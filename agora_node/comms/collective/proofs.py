"""Signed parts: who sent what to a span's owner and witness, provably.

Every part a member pushes carries its signature over (group id, span, weight, sha256 of
the frame). The receiver checks it before keeping the part (handlers.py), and a span's
result, and a witness's answer about it, carry the signed entries of the parts they
aggregated, in plan order (one `Proof` per part named).

When a result fails its witness check (verify.py), the two lists say who lied:

- a member with two entries for the span, both signed by it, that differ: it sent one
  part to the owner and another to the witness (it *equivocated*); the owner and the
  witness are honest, whatever the check said;
- an entry whose signature does not verify: whoever presented it made it up (the owner
  or the witness);
- the same signed entries on both sides: one of the two reduced them wrongly, and the
  member cannot tell which (both flagged, as before signatures).

A signature binds the sender to one frame per span and collective, which is what an
honest member sends: the same frame to the owner, the witness and a backup. A member
that restarts and re-enters the same collective with a new part is an equivocator by this
rule (rare: a restart takes longer than a collective's deadlines).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass

from agora_node.protocol.names import COLLECTIVE_PART_DOMAIN, COLLECTIVE_RECEIPT_DOMAIN

DIGEST_BYTES = 32
SIGNATURE_BYTES = 64
PROOF_BYTES = 8 + DIGEST_BYTES + SIGNATURE_BYTES
MAX_PROOFS_BYTES = PROOF_BYTES * 1024
"""What a reply may carry in proofs at most (a group of 1024); plans check the exact count."""
MAX_RECEIPT_BYTES = 128 + SIGNATURE_BYTES
"""A receipt: a members mask (a group of 1024 at most) and the witness's signature."""
MAX_RECEIPTS = 2
"""A result carries its inventory's receipt and, if that lacks the owner's part, the
witness's receipt for the owner's own copy (`read_receipts`)."""

Verify = Callable[[str, bytes, bytes], bool]
"""(peer id, message, signature) -> whether the peer signed it (protocol.identity.verify)."""


@dataclass(frozen=True)
class Signing:
    """How a member signs its parts and checks others' (a daemon: its Identity and
    `protocol.identity.verify`; in-process tests: keys by member name)."""

    sign: Callable[[bytes], bytes]
    verify: Verify


@dataclass(frozen=True)
class Proof:
    """A sender's signed statement: 'my part of this span weighs `weight` and hashes to
    `digest`'."""

    weight: float
    digest: bytes
    signature: bytes

    def pack(self) -> bytes:
        return struct.pack("<d", self.weight) + self.digest + self.signature


def statement(group_id: bytes, span: int, weight: float, digest: bytes) -> bytes:
    """What a sender signs for its part of `span` (the group id names round, phase, run,
    stage and members: plan.py)."""
    return COLLECTIVE_PART_DOMAIN + group_id + struct.pack("<Id", span, weight) + digest


def digest(frame: bytes) -> bytes:
    return hashlib.sha256(frame).digest()


def sign_part(signing: Signing, group_id: bytes, span: int, weight: float, frame: bytes) -> Proof:
    d = digest(frame)
    return Proof(weight, d, signing.sign(statement(group_id, span, weight, d)))


def check_part(
    verify: Verify, sender: str, group_id: bytes, span: int, weight: float, frame: bytes, sig: bytes
) -> Proof | None:
    """The proof of a received part, or None if `sig` is not the sender's over it."""
    if len(sig) != SIGNATURE_BYTES:
        return None
    d = digest(frame)
    if not verify(sender, statement(group_id, span, weight, d), sig):
        return None
    return Proof(weight, d, sig)


def receipt_statement(group_id: bytes, span: int, mask: bytes) -> bytes:
    """What a span's witness signs for the parts it holds (`mask`, verify.members_mask)."""
    return COLLECTIVE_RECEIPT_DOMAIN + group_id + struct.pack("<I", span) + mask


def sign_receipt(sign: Callable[[bytes], bytes], group_id: bytes, span: int, mask: bytes) -> bytes:
    """A witness's receipt for the parts of `span` it holds: the mask, then its signature.
    Parts are never dropped during a collective, so it stays true for the whole round: a
    witness that later answers a check with one of them "missing" lies."""
    return mask + sign(receipt_statement(group_id, span, mask))


def read_receipt(
    verify: Verify, witness: str, group_id: bytes, span: int, receipt: bytes
) -> bytes | None:
    """The mask of a receipt `witness` signed for `span`, or None (none, or not its)."""
    if not SIGNATURE_BYTES < len(receipt) <= MAX_RECEIPT_BYTES:
        return None
    mask, sig = receipt[:-SIGNATURE_BYTES], receipt[-SIGNATURE_BYTES:]
    return mask if verify(witness, receipt_statement(group_id, span, mask), sig) else None


def read_receipts(
    verify: Verify, witness: str, group_id: bytes, span: int, receipts: bytes, mask_len: int
) -> bytes | None:
    """The union of the masks of the receipts `witness` signed for `span` that `receipts`
    holds back to back (the inventory's, and the one for the owner's own copy when the
    inventory lacks it: at most MAX_RECEIPTS), or None if any is not its."""
    size = mask_len + SIGNATURE_BYTES
    if not receipts or len(receipts) % size or len(receipts) > MAX_RECEIPTS * size:
        return None
    union = 0
    for i in range(0, len(receipts), size):
        mask = read_receipt(verify, witness, group_id, span, receipts[i : i + size])
        if mask is None:
            return None
        union |= int.from_bytes(mask, "little")
    return union.to_bytes(mask_len, "little")


def pack_proofs(proofs: list[Proof | None]) -> bytes:
    """The entries of a result or witness answer (b"" if any part was unsigned)."""
    if any(p is None for p in proofs):
        return b""
    return b"".join(p.pack() for p in proofs)  # type: ignore[union-attr]


def parse_proofs(data: bytes, count: int) -> list[Proof] | None:
    """`count` entries from the wire, or None if `data` is not that many."""
    if len(data) != count * PROOF_BYTES:
        return None
    out = []
    for i in range(0, len(data), PROOF_BYTES):
        (weight,) = struct.unpack_from("<d", data, i)
        d = data[i + 8 : i + 8 + DIGEST_BYTES]
        out.append(Proof(weight, d, data[i + 8 + DIGEST_BYTES : i + PROOF_BYTES]))
    return out


def held_alike(
    verify: Verify,
    group_id: bytes,
    span: int,
    held: list[str],
    witness_proofs: bytes,
    ours: dict[str, Proof | None],
) -> tuple[set[str], set[str]] | None:
    """An owner's reading of its witness's inventory (`held`, plan order, with their
    entries): the members whose part the witness holds with the same entry as the owner,
    and those whose two entries are both validly signed and differ (equivocators). None
    if an entry of the witness's does not verify (its answer is worth nothing)."""
    theirs = parse_proofs(witness_proofs, len(held))
    if theirs is None:
        return None
    alike, two_parts = set(), set()
    for m, p in zip(held, theirs, strict=True):
        if not verify(m, statement(group_id, span, p.weight, p.digest), p.signature):
            return None
        mine = ours.get(m)
        if mine is not None and (mine.weight, mine.digest) == (p.weight, p.digest):
            alike.add(m)
        elif mine is not None:
            two_parts.add(m)
    return alike, two_parts


@dataclass(frozen=True)
class Verdict:
    """Who a failed check points at (`attribute`)."""

    equivocators: frozenset[str] = frozenset()
    owner_forged: bool = False
    witness_forged: bool = False

    @property
    def reducer_unknown(self) -> bool:
        """Nothing in the entries explains the mismatch: the owner or the witness reduced
        wrongly, and which one cannot be told."""
        return not (self.equivocators or self.owner_forged or self.witness_forged)


def attribute(
    verify: Verify,
    group_id: bytes,
    span: int,
    named: list[str],
    owner_proofs: bytes,
    witness_proofs: bytes,
) -> Verdict:
    """Compare the signed entries an owner's result and its witness's answer give for the
    parts `named` (plan order), after the two values disagreed. Runs at most 2 x len(named)
    signature checks, only for a failed check."""
    ours = parse_proofs(owner_proofs, len(named))
    theirs = parse_proofs(witness_proofs, len(named))

    def valid(sender: str, p: Proof) -> bool:
        return verify(sender, statement(group_id, span, p.weight, p.digest), p.signature)

    owner_forged = ours is None or not all(valid(m, p) for m, p in zip(named, ours, strict=True))
    witness_forged = theirs is None or not all(
        valid(m, p) for m, p in zip(named, theirs, strict=True)
    )
    if owner_forged or witness_forged:
        return Verdict(owner_forged=owner_forged, witness_forged=witness_forged)
    assert ours is not None and theirs is not None
    two_parts = frozenset(
        m
        for m, a, b in zip(named, ours, theirs, strict=True)
        if (a.weight, a.digest) != (b.weight, b.digest)
    )
    return Verdict(equivocators=two_parts)
