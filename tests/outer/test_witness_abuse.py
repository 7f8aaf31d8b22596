"""A witness's checks, inventories and backups under abuse: a member cannot use checks up
for the others, a short wait decides nothing for the other askers, an owner whose witness
lacks its own part sends it again, a witness denying its receipt is blamed, a backup
asking early gets no promise (nor one asking before members run), and a forged inventory
changes nothing.
Transport-free (LocalNetwork), real keys; each test but "sent-again" failed before its fix."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from itertools import combinations

import pytest
import torch

from agora_node.comms.collective import LocalNetwork
from agora_node.comms.collective.handlers import Responder
from agora_node.comms.collective.payload import encode_result, plain_format
from agora_node.comms.collective.plan import GroupPlan, span_bounds
from agora_node.comms.collective.proofs import Signing
from agora_node.comms.collective.verify import NONCE_BYTES, mask_members, members_mask
from agora_node.comms.collective.wire import Code, Header, Reply, rejected
from agora_node.protocol.identity import verify
from tests.outer.helpers import run_group
from tests.outer.test_proofs import NUMEL, _value, keyed, values_for

pytestmark = pytest.mark.timeout(60)


class Tripling(Responder):
    """Serves its span's result tripled (its entries are genuine)."""

    async def on_fetch(self, sender, header):  # noqa: ANN001, ANN201
        reply = await super().on_fetch(sender, header)
        if reply.code is not Code.FINAL:
            return reply
        return replace(reply, payload=encode_result(3 * _value(reply.payload), plain_format()))


class AskingAround:
    """Asks the witness of each span in `spans` checks over all parts, then over every
    smallest majority of parts including the span's owner, next to its witness copy of that span: before it (`first`,
    with a short wait, when the parts are not all there), or after it (waiting for them)."""

    def __init__(self, inner, members: tuple[str, ...], spans: set[int], first: bool) -> None:  # noqa: ANN001
        self.inner, self.members, self.spans, self.first = inner, members, spans, first
        self.answers: list[Reply] = []

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply:
        if header.attempt != 1 or header.span not in self.spans:
            return await self.inner.push(peer, header, payload)
        if not self.first:
            reply = await self.inner.push(peer, header, payload)
        owner = self.members[header.span]
        others = [m for m in self.members if m != owner]
        wait = 0.3 if self.first else 5.0
        ask = Header(header.round, header.phase, header.group_id, header.span, 0, 0.0, wait)
        every = [tuple(others), *combinations(others, len(self.members) // 2)]
        for more in every:
            mask = members_mask(self.members, (owner, *more))
            self.answers.append(await self.inner.check(peer, ask, os.urandom(NONCE_BYTES), mask))
        return reply if not self.first else await self.inner.push(peer, header, payload)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


async def _mix(values: dict[str, torch.Tensor], *, signing: dict[str, Signing], **kwargs):  # noqa: ANN202
    """One verified collective among `values`' keys, parts signed (helpers.run_group)."""
    return await run_group(values, verify=True, signing=signing, **kwargs)


def _network(names: list[str], signing: dict[str, Signing]) -> LocalNetwork:
    network = LocalNetwork(verify=verify)
    for p in names:
        network.join(p, signing[p])
    return network


async def test_an_owner_cannot_use_up_its_witness_checks_to_pass_a_forged_result() -> None:
    """Before: the owner had its witness reduce 4 sets of parts of its choosing, the
    members' checks were then answered "busy", counted unchecked, and the tripled span was
    adopted by everyone. Now a witness refuses checks from the span's owner."""
    names, _, signing = keyed(5)
    network, liar = _network(names, signing), names[0]
    network.responders[liar] = Tripling(network.responders[liar].book, verify=verify)
    asking = AskingAround(network.transport(liar), tuple(names), spans={0}, first=False)
    values = values_for(names, seed=11)
    outs = await _mix(values, network=network, transports={liar: asking}, signing=signing)
    assert asking.answers and all(
        a.code is Code.REJECTED and a.reason == "bad check" for a in asking.answers
    )
    lo, hi = span_bounds(NUMEL, len(names), 64)[0]
    for p in names[1:]:
        stats = outs[p].stats
        assert liar in stats.mismatched and stats.unchecked_spans == 0, stats.rejected
        assert torch.equal(outs[p].value[lo:hi], values[p][lo:hi])  # not adopted: own values


async def test_a_member_asking_many_checks_leaves_the_others_theirs() -> None:
    """A member may have the witness reduce MASKS_PER_ASKER sets of parts; past that its
    checks are refused as busy, and the other members' checks are still answered."""
    names, _, signing = keyed(5)
    network, spammer = _network(names, signing), names[2]
    asking = AskingAround(network.transport(spammer), tuple(names), spans={0}, first=False)
    outs = await _mix(
        values_for(names, seed=12),
        network=network,
        transports={spammer: asking},
        signing=signing,
    )
    codes = [(a.code, a.reason.split(":")[0]) for a in asking.answers]
    assert codes[:2] == [(Code.SKETCH, "")] * 2
    assert (Code.REJECTED, "witness busy") in codes, codes
    first = outs[names[0]].value
    for p in names:
        if p == spammer:
            continue
        assert outs[p].consistent and torch.equal(outs[p].value, first)
        assert not outs[p].stats.mismatched and outs[p].stats.unchecked_spans == 0


@pytest.mark.parametrize("late_owner", [False, True], ids=["on-time", "late-owner"])
async def test_a_check_with_a_short_wait_decides_nothing_for_the_others(late_owner: bool) -> None:
    """A member asks each witness about the full set of parts, with a short wait, before it
    sends its own copy. Before: the witness cached "lacking that member" for that set, every
    span fell back, and with an owner late to start, the honest owner and witness were
    flagged. Now each asker waits on its own and only complete reductions are cached."""
    names, _, signing = keyed(4)
    network, liar = _network(names, signing), names[3]
    asking = AskingAround(network.transport(liar), tuple(names), {0, 1, 2}, first=True)
    before = {names[1]: lambda: asyncio.sleep(0.5)} if late_owner else None
    outs = await _mix(
        values_for(names, seed=13),
        network=network,
        transports={liar: asking},
        signing=signing,
        before=before,
    )
    assert any(a.code is Code.NOTHING for a in asking.answers)
    for p in names[:3]:
        stats = outs[p].stats
        assert outs[p].consistent and stats.fallback_spans == 0, stats.rejected
        assert not stats.mismatched and not stats.mismatch_witnesses


class LosingOwnCopies:
    """The owner's copies of its own span for its witness get lost: the first `lose` (the
    transport says ACCEPTED), then, if `refuse`, every later one is refused."""

    def __init__(self, inner, span: int, lose: int, refuse: bool) -> None:  # noqa: ANN001
        self.inner, self.span, self.lose, self.refuse = inner, span, lose, refuse
        self.copies = 0

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply:
        if header.attempt == 1 and header.span == self.span:
            self.copies += 1
            if self.copies <= self.lose:
                return Reply(Code.ACCEPTED)
            if self.refuse:
                return rejected("late")
        return await self.inner.push(peer, header, payload)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


async def test_an_owner_whose_witness_lacks_its_part_sends_it_again() -> None:
    """The witness's inventory shows the owner's own copy missing: the owner sends it again,
    asks for a receipt that lists it, and its result is checked; nobody is flagged."""
    names, _, signing = keyed(4)
    network, owner = _network(names, signing), names[0]
    losing = LosingOwnCopies(network.transport(owner), span=0, lose=1, refuse=False)
    outs = await _mix(
        values_for(names, seed=14),
        network=network,
        transports={owner: losing},
        signing=signing,
    )
    assert losing.copies == 2
    first = outs[owner].value
    for p in names:
        stats = outs[p].stats
        assert outs[p].consistent and torch.equal(outs[p].value, first), stats.rejected
        assert not stats.mismatched and not stats.mismatch_witnesses
        assert stats.checked_spans == 3 and stats.late_spans == 0
    assert outs[owner].stats.rejected["witness lacks the owner's part"] == 0


async def test_an_owner_whose_copy_its_witness_refuses_publishes_and_is_not_adopted() -> None:
    """The witness lacks the owner's part and refuses it again. The owner publishes anyway
    (handing the span to the witness that refused would let it decide the span unchecked);
    the members cannot tell which of the two lies, flag both, and keep their own values."""
    names, _, signing = keyed(4)
    network, owner, witness = _network(names, signing), names[0], names[1]
    losing = LosingOwnCopies(network.transport(owner), span=0, lose=1, refuse=True)
    values = values_for(names, seed=14)
    outs = await _mix(values, network=network, transports={owner: losing}, signing=signing)
    assert outs[owner].stats.rejected["witness lacks the owner's part"] == 1
    lo, hi = span_bounds(NUMEL, len(names), 64)[0]
    for p in names[2:]:
        stats = outs[p].stats
        assert stats.mismatched == {owner} and stats.mismatch_witnesses == {witness}
        assert torch.equal(outs[p].value[lo:hi], values[p][lo:hi])


class EarlyBackup:
    """A witness that asks every member to promise its span's attempt 1 as soon as they run
    the collective, before the owner's result could be checked, and then serves a forged
    attempt-1 result."""

    def __init__(self, inner, network: LocalNetwork, members: tuple[str, ...], span: int) -> None:  # noqa: ANN001
        self.inner, self.network, self.members, self.span = inner, network, members, span
        self.answers: list[Reply] = []
        self.asked = False
        self.tasks: list[asyncio.Future] = []

    async def _all_running(self) -> None:
        """Until every member runs the collective (its AllReduce fires `changed` then)."""
        for m in self.members:
            for state in list(self.network.responders[m].book.states.values()):
                await state.changed.wait_for(lambda s=state: s.opens is not None, 5.0)

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply:
        if not self.asked:
            self.asked = True
            await self._all_running()
            ask = Header(header.round, header.phase, header.group_id, self.span, 1, 0.0, 0.0)
            others = [m for m in self.members if m != self.members[self.span + 1]]
            for m in others:  # not awaited here: the members hold these queries
                self.tasks.append(asyncio.ensure_future(self._ask(m, ask)))
        return await self.inner.push(peer, header, payload)

    async def _ask(self, member: str, header: Header) -> None:
        self.answers.append(await self.inner.query(member, header))

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


async def test_a_witness_asking_for_promises_early_cannot_take_the_span_over() -> None:
    """Before: members promised attempt 1 to whoever was its owner whenever asked, dropped
    their fetch of the owner's result and adopted the witness's attempt-1 result, which is
    not checked. Now a running member promises only once it would move on by itself."""
    names, _, signing = keyed(4)
    network, witness = _network(names, signing), names[1]
    network.responders[witness] = Tripling(network.responders[witness].book, verify=verify)
    early = EarlyBackup(network.transport(witness), network, tuple(names), span=0)
    values = values_for(names, seed=19)
    outs = await _mix(values, network=network, transports={witness: early}, signing=signing)
    lo, hi = span_bounds(NUMEL, len(names), 64)[0]
    owners = outs[names[0]].value[lo:hi]  # the owner's own result (robustly aggregated)
    assert owners.norm() < 0.6 * sum(values.values())[lo:hi].norm()  # not tripled
    for p in names[2:]:
        assert torch.equal(outs[p].value[lo:hi], owners), outs[p].stats.rejected
    # each member held the query until it would move on itself, by then holding the
    # owner's result: it answered with that, and promised nothing
    for task in early.tasks:
        task.cancel()
    for p in (names[0], names[2], names[3]):
        (state,) = network.responders[p].book.states.values()
        assert state.spans[0].min_attempt == 0
    assert all(a.code is Code.FINAL for a in early.answers)


class LateChecks(Tripling):
    """Tripling, and answers the members' checks of span 0 just after they would move on
    to attempt 1 by themselves, yet within their network slack (not a failed call)."""

    async def on_check(self, sender, header, nonce, members=b""):  # noqa: ANN001, ANN201
        if header.span == 0:
            await asyncio.sleep(header.wait + 0.5)  # the attack's timing, not a wait on an event
        return await super().on_check(sender, header, nonce, members)


@pytest.mark.parametrize("checks", ["prompt", "late"])
@pytest.mark.parametrize("when", ["unregistered", "registered", "running"])
async def test_a_witness_asking_before_members_run_cannot_take_the_span_over(
    when: str, checks: str
) -> None:
    """Before: a member asked before it ran the collective (not yet registered, or not yet
    started) promised at once. A witness asking everyone as matchmaking closed had the owner
    abandon its span and the members refuse the owner's result, and its own attempt-1
    result, unchecked, was adopted tripled. Now such a promise is kept only once the member
    would move on by itself, and the owner drops it when another member takes its parts.
    Nor does a member holding the owner's result promise while it checks it: a witness
    answering the check late had the checked result refused as stale (review of a8fd329;
    that also held for queries asked while members ran)."""
    names, _, signing = keyed(4)
    network, witness = _network(names, signing), names[1]
    kind = LateChecks if checks == "late" else Tripling
    network.responders[witness] = kind(network.responders[witness].book, verify=verify)
    plan = GroupPlan(round=0, phase="delta", members=tuple(names), numel=NUMEL, block=64)
    ask = Header(0, "delta", plan.group_id, 0, 1, 0.0, 0.0)

    async def asked(p: str) -> None:
        assert (await network.responders[p].on_query(witness, ask)).code is Code.NOTHING

    others = [p for p in names if p != witness]
    if when == "unregistered":
        for p in others:
            await asked(p)
    before = {p: (lambda p=p: asked(p)) for p in others} if when == "registered" else None
    transports = {}
    if when == "running":
        transports[witness] = EarlyBackup(network.transport(witness), network, tuple(names), 0)
    values = values_for(names, seed=21)
    outs = await _mix(
        values, network=network, signing=signing, before=before, transports=transports
    )
    for task in getattr(transports.get(witness), "tasks", []):
        task.cancel()
    lo, hi = span_bounds(NUMEL, len(names), 64)[0]
    owners = outs[names[0]].value[lo:hi]
    assert owners.norm() < 0.6 * sum(values.values())[lo:hi].norm()  # not tripled
    if when != "running":
        assert outs[names[0]].stats.rejected["promise asked early"] == 1
    for p in names[2:]:
        stats = outs[p].stats
        assert torch.equal(outs[p].value[lo:hi], owners), stats.rejected
        assert stats.late_spans == 0 and stats.rejected["stale result"] == 0


class ForgedInventory(Responder):
    """A witness whose inventory answers carry entries it made up."""

    async def on_inventory(self, sender, header, members):  # noqa: ANN001, ANN201
        reply = await super().on_inventory(sender, header, members)
        if reply.code is not Code.HOLDS or not reply.proofs:
            return reply
        proofs = bytearray(reply.proofs)
        proofs[-1] ^= 1
        return replace(reply, proofs=bytes(proofs))


async def test_a_forged_inventory_is_counted_and_changes_nothing() -> None:
    names, _, signing = keyed(4)
    network, witness = _network(names, signing), names[1]
    network.responders[witness] = ForgedInventory(network.responders[witness].book, verify=verify)
    outs = await _mix(values_for(names, seed=15), network=network, signing=signing)
    assert outs[names[0]].stats.rejected["forged inventory"] == 1
    first = outs[names[0]].value
    for p in names:
        assert outs[p].consistent and torch.equal(outs[p].value, first)
        assert not outs[p].stats.mismatched and not outs[p].stats.equivocated


async def test_a_negative_zero_weight_is_signed_as_sent() -> None:
    """-0.0 was signed as such but sent as 0.0: every part of that member was refused."""
    names, _, signing = keyed(3)
    weights = {p: 1.0 for p in names} | {names[2]: -0.0}
    outs = await _mix(
        values_for(names, seed=16),
        weights=weights,
        network=_network(names, signing),
        signing=signing,
    )
    for p in names:
        assert outs[p].stats.rejected["bad signature"] == 0 and outs[p].consistent


class DenyingWitness(Responder):
    """Holds every part, but answers checks that it lacks `denied` (the span's owner's or
    another member's)."""

    def __init__(self, book, denied: str, **kwargs) -> None:  # noqa: ANN001, ANN003
        super().__init__(book, **kwargs)
        self.denied = denied

    async def on_check(self, sender, header, nonce, members=b""):  # noqa: ANN001, ANN201
        state = await self.book.lookup(header.round, header.phase, header.group_id, 5.0)
        return Reply(Code.NOTHING, members=members_mask(state.plan.members, [self.denied]))


@pytest.mark.parametrize("denied", [0, 2], ids=["owner", "member"])
async def test_a_witness_denying_a_part_it_signed_for_is_blamed_alone(denied: int) -> None:
    """The witness's inventory answer carries its signed receipt, and the owner's result
    passes it on: a witness that then answers a check "I lack that part" contradicts its own
    signature. Before: denying the owner's part flagged the honest owner too, and denying
    another member's flagged nobody."""
    names, _, signing = keyed(4)
    network, witness = _network(names, signing), names[1]
    network.responders[witness] = DenyingWitness(
        network.responders[witness].book, names[denied], verify=verify, sign=signing[witness].sign
    )
    values = values_for(names, seed=17)
    outs = await _mix(values, network=network, signing=signing)
    lo, hi = span_bounds(NUMEL, len(names), 64)[0]
    for p in names[2:]:  # the members that check span 0 through the liar
        stats = outs[p].stats
        assert stats.mismatch_witnesses == {witness} and not stats.mismatched, stats.rejected
        assert stats.rejected["witness denies its receipt"] == 1
        assert torch.equal(outs[p].value[lo:hi], values[p][lo:hi])  # not adopted


class OmittingWitness(DenyingWitness):
    """Takes the owner's copies (the honest handler signs for them), leaves the owner out
    of every inventory answer, then answers checks that it lacks the owner's part."""

    async def on_inventory(self, sender, header, members):  # noqa: ANN001, ANN201
        state = await self.book.lookup(header.round, header.phase, header.group_id, 5.0)
        named = mask_members(state.plan.members, members) or []
        without = members_mask(state.plan.members, [m for m in named if m != self.denied])
        return await super().on_inventory(sender, header, without)


class RefusingInventory(DenyingWitness):
    """Takes the owner's copies, refuses its inventory, denies the owner's part in checks."""

    async def on_inventory(self, sender, header, members):  # noqa: ANN001, ANN201
        return rejected("busy")


class BrokenInventory(DenyingWitness):
    """Lists the owner in its inventory, but the answer's receipt (`receipt`) or one of its
    entries (`entry`) does not verify; denies the owner's part in checks."""

    broken = "receipt"

    async def on_inventory(self, sender, header, members):  # noqa: ANN001, ANN201
        reply = await super().on_inventory(sender, header, members)
        if reply.code is not Code.HOLDS or not reply.proofs:
            return reply
        field = self.broken + ("s" if self.broken == "proof" else "")
        data = bytearray(getattr(reply, field))
        data[-1] ^= 1
        return replace(reply, **{field: bytes(data)})


class BrokenEntry(BrokenInventory):
    broken = "proof"


class LateAcknowledging(RefusingInventory):
    """Refuses the inventory and holds its answer to the owner's copy a while (the copy
    is kept and signed for): the owner is ready to publish before the receipt arrives."""

    async def on_push(self, sender, header, payload):  # noqa: ANN001, ANN201
        reply = await super().on_push(sender, header, payload)
        if header.attempt == 1 and sender == self.denied:
            await asyncio.sleep(0.25)  # the attack's timing: the owner is done by then; < base / 4
        return reply


WITNESSES = {
    "omits the owner": "OmittingWitness",
    "refused": "RefusingInventory",
    "bad receipt": "BrokenInventory",
    "bad entry": "BrokenEntry",
    "late answer to the copy": "LateAcknowledging",
}


@pytest.mark.parametrize("inventory", list(WITNESSES))
async def test_a_witness_leaving_the_owners_copy_out_is_blamed_alone(inventory: str) -> None:
    """Before: a witness that took the owner's copy but left it out of its inventory (or
    refused the inventory), even after the owner sent it again, then answered checks
    "missing", got the honest owner flagged with it. Now the witness signs a receipt when
    it takes its owner's copy, and the result carries it whenever no valid inventory
    receipt lists the owner (a review found three ways around a first version: a broken
    inventory receipt, a broken entry, a copy answered after the owner published)."""
    names, _, signing = keyed(4)
    network, owner, witness = _network(names, signing), names[0], names[1]
    kind = globals()[WITNESSES[inventory]]
    network.responders[witness] = kind(
        network.responders[witness].book, owner, verify=verify, sign=signing[witness].sign
    )
    values = values_for(names, seed=23)
    outs = await _mix(values, network=network, signing=signing)
    lo, hi = span_bounds(NUMEL, len(names), 64)[0]
    for p in names[2:]:
        stats = outs[p].stats
        assert stats.mismatch_witnesses == {witness} and not stats.mismatched, stats.rejected
        assert stats.rejected["witness denies its receipt"] == 1
        assert torch.equal(outs[p].value[lo:hi], values[p][lo:hi])  # not adopted


async def test_a_receipt_the_owner_made_up_blames_no_witness() -> None:
    """An owner cannot make a receipt its witness did not sign: an altered one is read as
    none, and a witness lacking another member's part flags nobody, as without receipts."""
    names, _, signing = keyed(4)
    network, owner = _network(names, signing), names[0]

    class ClaimingMore(Responder):
        async def on_fetch(self, sender, header):  # noqa: ANN001, ANN202
            reply = await super().on_fetch(sender, header)
            if reply.code is not Code.FINAL or not reply.receipt:
                return reply
            return replace(reply, receipt=reply.receipt[:-1] + bytes([reply.receipt[-1] ^ 1]))

    network.responders[owner] = ClaimingMore(network.responders[owner].book, verify=verify)
    network.responders[names[1]] = DenyingWitness(
        network.responders[names[1]].book, names[2], verify=verify, sign=signing[names[1]].sign
    )
    outs = await _mix(values_for(names, seed=18), network=network, signing=signing)
    for p in names[2:]:
        stats = outs[p].stats
        assert not stats.mismatch_witnesses and not stats.mismatched, stats.rejected
        assert stats.rejected["witness lacks a part"] == 1


class FetchFailsOnce:
    """The first fetch from `owner` fails as a reset stream would."""

    def __init__(self, inner, owner: str) -> None:  # noqa: ANN001
        self.inner, self.owner, self.failed = inner, owner, False

    async def fetch(self, peer: str, header: Header) -> Reply:
        if peer == self.owner and not self.failed:
            self.failed = True
            raise ConnectionError("stream reset")
        return await self.inner.fetch(peer, header)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


async def test_an_honest_backup_asking_early_still_ends_with_the_group() -> None:
    """A backup whose fetch of a live owner failed asks the members at once. They hold its
    query until they would move on themselves, then answer with the owner's result, which
    the backup re-issues: everyone ends with the same value (refusing the query instead left
    the backup reducing alone, silently apart from the group)."""
    names, _, signing = keyed(4)
    network, owner, backup = _network(names, signing), names[0], names[1]
    flaky = FetchFailsOnce(network.transport(backup), owner)
    outs = await _mix(
        values_for(names, seed=20),
        network=network,
        transports={backup: flaky},
        signing=signing,
    )
    assert flaky.failed
    first = outs[owner].value
    for p in names:
        assert outs[p].consistent and torch.equal(outs[p].value, first), outs[p].stats.rejected
        assert not outs[p].stats.mismatched and not outs[p].stats.mismatch_witnesses
