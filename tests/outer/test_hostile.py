"""A stranger outside a collective's group cannot register anything in it (issue 10):
promises, pushes and bookkeeping, transport-free (LocalNetwork)."""

import pytest
import torch

from agora_node.comms.collective import GroupPlan, LocalNetwork, RoundBook
from agora_node.comms.collective.handlers import Responder
from agora_node.comms.collective.payload import encode_result, plain_format
from agora_node.comms.collective.state import MAX_PENDING
from agora_node.comms.collective.wire import Code, Header
from tests.outer.helpers import all_equal, peers, random_values, run_group

pytestmark = pytest.mark.timeout(60)
NUMEL = 3000


def _plan(members: list[str], round_no: int = 0) -> GroupPlan:
    return GroupPlan(round=round_no, phase="delta", members=tuple(members), numel=NUMEL, block=64)


async def test_a_strangers_promises_do_not_force_members_into_fall_back() -> None:
    """main applied any peer's promise at registration: a stranger who computed the group
    id (public: it hashes the round's entries) made every member abandon its own span."""
    members = peers(3)
    network = LocalNetwork()
    for p in members:
        network.join(p)
    plan = _plan(members)
    for p in members:
        for span in range(plan.size):
            for attempt in range(1, plan.size):
                header = Header(0, "delta", plan.group_id, span, attempt)
                reply = await network.responders[p].on_query("stranger", header)
                assert reply.code is Code.NOTHING  # it learns nothing either
    values = random_values(3, NUMEL)
    outs = await run_group(values, network=network)
    assert all_equal(outs)
    for out in outs.values():
        assert out.consistent and out.stats.repaired_spans == 0 and out.stats.fallback_spans == 0
    torch.testing.assert_close(outs["peer0"].value, sum(values.values()) / 3, atol=1e-5, rtol=0)
    book = network.responders["peer0"].book
    assert book.unknown_rejections["promise from a non-owner"] == plan.size  # one per span


async def test_the_backup_owners_promise_still_holds() -> None:
    """The promise a late registration must keep (a backup re-reduced the span) is kept."""
    book, members = RoundBook("peer0"), peers(3)
    plan = _plan(members)
    backup = plan.owner(0, 1)
    header = Header(0, "delta", plan.group_id, 0, 1)
    assert (await Responder(book).on_query(backup, header)).code is Code.NOTHING
    state = book.register(plan)
    assert state.spans[0].min_attempt == 1


async def test_round_bookkeeping_stays_bounded_whatever_strangers_send() -> None:
    book = RoundBook("peer0")
    responder = Responder(book)
    for i in range(3 * MAX_PENDING):  # distinct rounds and groups: main kept every one
        header = Header(i, "delta", i.to_bytes(16, "big"), 0, 1)
        await responder.on_query("stranger", header)
    assert sum(len(v) for v in book.pending.values()) <= MAX_PENDING
    book.register(_plan(peers(3), round_no=10))
    assert all(8 <= r <= 12 for r, _, _ in book.pending)  # pruned around the own round
    far = Header(10**9, "anchor", b"x" * 16, 0, 1)
    await responder.on_query("stranger", far)
    assert all(r != 10**9 for r, _, _ in book.pending)


async def test_a_push_is_refused_on_its_header_before_its_payload_is_read() -> None:
    """Transports ask admit_push on the first chunk: a non-member, a wrong span or a frame
    announced larger than its span can hold is refused without being buffered."""
    members = peers(3)
    book = RoundBook("peer0")
    plan = _plan(members)
    book.register(plan)
    responder = Responder(book)
    header = Header(0, "delta", plan.group_id, 0, 0, weight=1.0)
    ok = encode_result(torch.zeros(plan.span_numel(0)), plain_format())
    assert await responder.admit_push("peer1", header, len(ok)) is None
    refusals = {
        "not a member": await responder.admit_push("stranger", header, len(ok)),
        "not my span": await responder.admit_push(
            "peer1", Header(0, "delta", plan.group_id, 1, 0, weight=1.0), len(ok)
        ),
        "oversized": await responder.admit_push("peer2", header, 1 << 30),
    }
    for reason, reply in refusals.items():
        assert reply is not None and reply.code is Code.REJECTED and reply.reason == reason
