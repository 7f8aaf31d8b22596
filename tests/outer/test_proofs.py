"""Signed parts (proofs.py): a failed witness check blames the member that sent two parts,
not the honest owner and witness; a forged entry blames whoever presented it; a part
whose witness copy never came blames nobody. Transport-free (LocalNetwork), real keys."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agora_node.comms.collective import LocalNetwork
from agora_node.comms.collective.handlers import Responder
from agora_node.comms.collective.payload import encode_result, plain_format
from agora_node.comms.collective.plan import GroupPlan, span_bounds
from agora_node.comms.collective.proofs import (
    Proof,
    Signing,
    attribute,
    digest,
    pack_proofs,
    read_receipt,
    read_receipts,
    sign_part,
    sign_receipt,
    statement,
)
from agora_node.comms.collective.wire import Code, Header, Reply
from agora_node.compression import decode_frame, dequantize
from agora_node.protocol.identity import Identity, verify
from tests.outer.harness import Equivocating
from tests.outer.helpers import run_group

pytestmark = pytest.mark.timeout(60)
NUMEL = 3000


def keyed(n: int) -> tuple[list[str], dict[str, Identity], dict[str, Signing]]:
    ids = [Identity.generate() for _ in range(n)]
    names = [i.peer_id for i in ids]
    return (
        names,
        dict(zip(names, ids, strict=True)),
        {i.peer_id: Signing(i.sign, verify) for i in ids},
    )


def values_for(names: list[str], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=g)
    return {p: common + torch.randn(NUMEL, generator=g) for p in names}


def _value(frame: bytes) -> torch.Tensor:
    return dequantize(decode_frame(frame, max_bytes=1 << 24))


class Withholding:
    """Never sends other spans' witnesses their copy (says it did); owners get the part."""

    def __init__(self, inner, own_span: int) -> None:  # noqa: ANN001
        self.inner, self.own_span = inner, own_span

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply:
        if header.attempt == 1 and header.span != self.own_span:
            return Reply(Code.ACCEPTED)
        return await self.inner.push(peer, header, payload)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


class NoInventory:
    """An owner whose witness refuses its inventory (as if it were busy): it names every
    part it got, and the members' checks must sort out a broken span."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner

    async def inventory(self, peer: str, header: Header, members: bytes) -> Reply:
        return Reply(Code.REJECTED, reason="busy")

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def _transports(network: LocalNetwork, names: list[str], liar: str, inventory: bool) -> dict:
    return {} if inventory else {p: NoInventory(network.transport(p)) for p in names if p != liar}


@pytest.mark.parametrize("inventory", [True, False], ids=["inventory", "no-inventory"])
@pytest.mark.parametrize("n", [3, 4])
async def test_a_member_sending_two_parts_is_blamed_not_the_owner_or_witness(
    n: int, inventory: bool
) -> None:
    """Before signed parts, every member that checked flagged the honest owner and witness of
    each span the liar's two parts broke. Now an owner, comparing its parts' entries with
    its witness's inventory, drops the liar's part and flags the liar; and where a result
    named it anyway (no inventory), the members flag the liar from its two signatures."""
    names, ids, signing = keyed(n)
    network = LocalNetwork(verify=verify)
    for p in names:
        network.join(p, signing[p])
    liar = names[1]
    transports = _transports(network, names, liar, inventory)
    transports[liar] = Equivocating(network.transport(liar), ids[liar])
    values = values_for(names, seed=3)
    outs = await run_group(
        values, network=network, transports=transports, verify=True, signing=signing
    )
    honest = [p for p in names if p != liar]
    for p in honest:
        stats = outs[p].stats
        assert stats.equivocated == {liar}, stats.rejected
        assert not stats.mismatched and not stats.mismatch_witnesses
        assert stats.rejected["equivocation"] >= 1
    spans = span_bounds(NUMEL, n, 64)
    if inventory:  # every span mixed, none with the liar's 1.5x part
        assert all(outs[p].consistent for p in honest)
        assert all(torch.equal(outs[p].value, outs[honest[0]].value) for p in honest)
        lo, hi = spans[0]  # an honest owner's span: the mean of the honest parts
        mean = sum(values[p] for p in honest) / len(honest)
        torch.testing.assert_close(outs[honest[0]].value[lo:hi], mean[lo:hi], atol=1e-5, rtol=0)
        return
    for p in honest:  # broken spans fall back to the member's own values
        for j, (lo, hi) in enumerate(spans):
            if names[j] not in (p, liar) and names[(j + 1) % n] != p:
                assert torch.equal(outs[p].value[lo:hi], values[p][lo:hi])


@pytest.mark.parametrize("inventory", [True, False], ids=["inventory", "no-inventory"])
async def test_a_part_withheld_from_the_witness_flags_nobody(inventory: bool) -> None:
    """The liar sends owners its parts and their witnesses none. With the inventory the
    owners leave its part out, and every span mixes. Without it (a witness that refused),
    the result names the part and the witness lacks it: the liar or the witness may be
    lying, or a copy was lost, so the span is not adopted and no one is flagged (before:
    the honest owner and witness). (An owner withholding its own part from its witness
    still gets both flagged: docs/security.md.)"""
    names, _, signing = keyed(4)
    network = LocalNetwork(verify=verify)
    for p in names:
        network.join(p, signing[p])
    liar = names[2]
    transports = _transports(network, names, liar, inventory)
    transports[liar] = Withholding(network.transport(liar), names.index(liar))
    outs = await run_group(
        values_for(names, seed=4),
        network=network,
        transports=transports,
        verify=True,
        signing=signing,
    )
    honest = [p for p in names if p != liar]
    for p in honest:
        stats = outs[p].stats
        assert not stats.mismatched and not stats.mismatch_witnesses and not stats.equivocated
    if inventory:
        assert all(outs[p].consistent for p in honest)
        dropped = sum(outs[p].stats.rejected["part its witness lacks"] for p in honest)
        assert dropped == 2  # by the honest owners whose witness is honest (the liar
        # witnesses one span, where it holds its own part)
    else:
        lacked = sum(outs[p].stats.rejected["witness lacks a part"] for p in honest)
        assert lacked >= 2  # the spans whose witness is honest, checked by their members


class ForgingOwner(Responder):
    """Serves its span's result tripled, with its entries' signatures broken."""

    async def on_fetch(self, sender, header):  # noqa: ANN001, ANN201
        reply = await super().on_fetch(sender, header)
        if reply.code is not Code.FINAL:
            return reply
        forged = encode_result(3 * _value(reply.payload), plain_format())
        proofs = bytearray(reply.proofs)
        proofs[-1] ^= 1  # a made-up entry (it cannot sign for the others)
        return replace(reply, payload=forged, proofs=bytes(proofs))


async def test_an_owner_presenting_a_forged_entry_is_blamed_alone() -> None:
    names, _, signing = keyed(4)
    network = LocalNetwork(verify=verify)
    for p in names:
        network.join(p, signing[p])
    forger = names[0]
    network.responders[forger] = ForgingOwner(network.responders[forger].book, verify=verify)
    outs = await run_group(values_for(names, seed=5), network=network, verify=True, signing=signing)
    witness = names[1]
    for p in names[1:]:
        stats = outs[p].stats
        assert stats.mismatched == {forger}, stats.rejected
        assert witness not in stats.mismatch_witnesses and not stats.equivocated


async def test_honest_signed_members_agree_and_blame_no_one() -> None:
    names, _, signing = keyed(4)
    network = LocalNetwork(verify=verify)
    values = values_for(names, seed=6)
    outs = await run_group(values, network=network, verify=True, signing=signing)
    first = next(iter(outs.values())).value
    for out in outs.values():
        assert torch.equal(out.value, first) and out.consistent
        assert out.stats.checked_spans == 3 and not out.stats.rejected
    torch.testing.assert_close(first, sum(values.values()) / 4, atol=1e-5, rtol=0)


async def test_a_part_without_its_senders_signature_is_refused() -> None:
    names, ids, _ = keyed(3)
    network = LocalNetwork(verify=verify)
    books = {p: network.join(p) for p in names}
    plan = GroupPlan(round=0, phase="delta", members=tuple(names), numel=NUMEL, block=64)
    for p in names:
        books[p].register(plan)
    owner, sender = names[0], names[1]
    frame = encode_result(torch.ones(plan.span_numel(0)), plain_format())
    good = ids[sender].sign(statement(plan.group_id, 0, 1.0, digest(frame)))
    by_other = ids[names[2]].sign(statement(plan.group_id, 0, 1.0, digest(frame)))
    heavier = ids[sender].sign(statement(plan.group_id, 0, 2.0, digest(frame)))
    responder = network.responders[owner]
    for sig in (b"", by_other, heavier, good[:-1] + bytes([good[-1] ^ 1])):
        header = Header(0, "delta", plan.group_id, 0, 0, 1.0, 0.0, sig)
        reply = await responder.on_push(sender, header, frame)
        assert reply.code is Code.REJECTED and reply.reason == "bad signature"
    state = books[owner].states[(0, "delta")]
    assert state.stats.rejected["bad signature"] == 4 and not state.spans[0].parts


def test_attribute_reads_the_entries() -> None:
    names, _, signing = keyed(3)
    group = b"g" * 16
    parts = {p: sign_part(signing[p], group, 1, 1.0, p.encode()) for p in names}
    honest = pack_proofs([parts[p] for p in names])
    assert attribute(verify, group, 1, names, honest, honest).reducer_unknown
    two = sign_part(signing[names[2]], group, 1, 1.0, b"another part")
    other = pack_proofs([parts[names[0]], parts[names[1]], two])
    verdict = attribute(verify, group, 1, names, honest, other)
    assert verdict.equivocators == {names[2]}
    bad = Proof(1.0, digest(b"x"), bytes(64))
    forged = pack_proofs([parts[names[0]], parts[names[1]], bad])
    v = attribute(verify, group, 1, names, forged, honest)
    assert v.owner_forged and not v.witness_forged and not v.equivocators
    v = attribute(verify, group, 1, names, honest, b"")
    assert v.witness_forged and not v.owner_forged
    v = attribute(verify, group, 2, names, honest, other)  # signed for span 1, not 2
    assert v.owner_forged and v.witness_forged


async def test_signatures_and_proofs_cross_the_p2p_messages() -> None:
    """The fields ride the collective's protobuf messages (p2p.py), proofs bounded."""
    from agora_node.comms.collective.p2p import _header, _read_reply, _reply_chunks, _request
    from agora_node.comms.collective.proofs import MAX_PROOFS_BYTES, MAX_RECEIPT_BYTES, MAX_RECEIPTS

    header = Header(3, "delta", b"g" * 16, 1, 0, 2.0, 1.0, b"s" * 64)
    assert _header(_request(Code.PART, header, b"frame", 5)) == header

    async def stream(msgs):  # noqa: ANN001, ANN202
        for m in msgs:
            yield m

    reply = Reply(Code.FINAL, b"x" * 10, 1, members=b"\x07", proofs=b"p" * 312, receipt=b"r" * 65)
    assert await _read_reply(stream(_reply_chunks(reply)), 100) == reply
    huge = replace(reply, proofs=b"p" * (MAX_PROOFS_BYTES + 1))
    with pytest.raises(ValueError, match="proofs"):
        await _read_reply(stream(_reply_chunks(huge)), 100)
    long = replace(reply, receipt=b"r" * (MAX_RECEIPTS * MAX_RECEIPT_BYTES + 1))
    with pytest.raises(ValueError, match="receipt"):
        await _read_reply(stream(_reply_chunks(long)), 100)


def test_a_receipt_reads_only_as_its_witness_signed_it() -> None:
    names, _, signing = keyed(2)
    group, witness = b"g" * 16, names[1]
    receipt = sign_receipt(signing[witness].sign, group, 0, b"\x03")
    assert read_receipt(verify, witness, group, 0, receipt) == b"\x03"
    assert read_receipt(verify, names[0], group, 0, receipt) is None  # not the owner's
    assert read_receipt(verify, witness, group, 1, receipt) is None  # another span
    assert read_receipt(verify, witness, b"h" * 16, 0, receipt) is None  # another group
    assert read_receipt(verify, witness, group, 0, b"\x01" + receipt[1:]) is None
    assert read_receipt(verify, witness, group, 0, receipt[-64:]) is None  # no mask
    assert read_receipt(verify, witness, group, 0, b"") is None


def test_two_receipts_read_as_the_union_of_what_their_witness_signed() -> None:
    """A result carries the inventory's receipt and, when that lacks the owner's part, the
    one its witness signed for the owner's copy: read together, or not at all."""
    names, _, signing = keyed(2)
    group, witness = b"g" * 16, names[1]
    inventory = sign_receipt(signing[witness].sign, group, 0, b"\x06")
    copy = sign_receipt(signing[witness].sign, group, 0, b"\x01")
    assert read_receipts(verify, witness, group, 0, inventory, 1) == b"\x06"
    assert read_receipts(verify, witness, group, 0, inventory + copy, 1) == b"\x07"
    forged = b"\x08" + copy[1:]
    assert read_receipts(verify, witness, group, 0, inventory + forged, 1) is None
    assert read_receipts(verify, witness, group, 0, inventory + copy + copy, 1) is None
    assert read_receipts(verify, witness, group, 0, inventory + copy[:-1], 1) is None
    assert read_receipts(verify, witness, group, 0, b"", 1) is None


async def test_only_the_spans_owner_may_ask_its_witness_for_an_inventory() -> None:
    names, _, _ = keyed(3)
    book = LocalNetwork(verify=verify).join(names[1])  # the witness of span 0
    plan = GroupPlan(round=0, phase="delta", members=tuple(names), numel=NUMEL, block=64)
    book.register(plan)
    responder = Responder(book, verify=verify)
    mask = b"\x07"
    for sender, span in ((names[2], 0), (names[0], 1)):  # not the owner; not its span
        reply = await responder.on_inventory(sender, Header(0, "delta", plan.group_id, span), mask)
        assert reply.code is Code.REJECTED and reply.reason == "bad inventory"
    answers = [
        await responder.on_inventory(names[0], Header(0, "delta", plan.group_id, 0), b"\x01")
        for _ in range(6)
    ]
    assert all(a.code is Code.HOLDS and a.members == b"\x00" for a in answers[:4])  # none yet
    assert all(a.code is Code.REJECTED for a in answers[4:])  # the cap: 4 per member
