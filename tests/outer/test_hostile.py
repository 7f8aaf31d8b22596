"""A stranger outside a collective's group cannot register anything in it, and a member
owning a span cannot forge its result (issue 10); transport-free (LocalNetwork)."""

import asyncio
import time

import pytest
import torch

from agora_node.comms.collective import GroupPlan, LocalNetwork, RoundBook
from agora_node.comms.collective.handlers import MAX_WAITING, MAX_WAITING_PER_PEER, Responder
from agora_node.comms.collective.payload import (
    PartEncoder,
    WireFormat,
    decode_span,
    encode_result,
    plain_format,
)
from agora_node.comms.collective.plan import span_bounds
from agora_node.comms.collective.state import MAX_PENDING
from agora_node.comms.collective.verify import members_mask, sketch, sketches_match
from agora_node.comms.collective.wire import Code, Header, Reply
from agora_node.protocol.codecs import Codec
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
    assert (state.spans[0].min_attempt, state.spans[0].deferred) == (0, 1)


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


async def test_a_stranger_cannot_hold_handlers_waiting_for_rounds() -> None:
    """A request about a round not registered yet holds its handler (and a stream slot)
    until the round is registered, up to its wait: only for rounds near this member's, and
    only MAX_WAITING_PER_PEER of one peer's at once (else a few keys held every slot for
    two minutes with a handful of requests)."""
    book = RoundBook("peer0")
    book.register(_plan(peers(3), round_no=10))
    responder = Responder(book)
    far = Header(10**9, "delta", b"x" * 16, 0, 0, wait=60.0)
    reply = await asyncio.wait_for(responder.on_fetch("stranger", far), 1.0)
    assert reply.code is Code.REJECTED and book.unknown_rejections["distant round"] == 1
    near = Header(11, "delta", b"x" * 16, 0, 0, wait=60.0)
    waits = [
        asyncio.create_task(responder.on_fetch("stranger", near))
        for _ in range(MAX_WAITING_PER_PEER)
    ]
    honest = asyncio.create_task(responder.on_fetch("peer1", near))
    try:
        deadline = time.monotonic() + 5
        while responder._waiting["stranger"] < MAX_WAITING_PER_PEER:
            assert time.monotonic() < deadline, "the waits did not start"
            await asyncio.sleep(0.01)
        extra = await asyncio.wait_for(responder.on_fetch("stranger", near), 1.0)
        assert extra.code is Code.REJECTED
        assert book.unknown_rejections["too many waits"] == 1
        assert not honest.done()  # another peer's request still waits for the round
    finally:
        for task in [*waits, honest]:
            task.cancel()
        await asyncio.gather(*waits, honest, return_exceptions=True)
    assert not responder._waiting  # released when the requests ended


async def test_fresh_keys_together_cannot_hold_more_than_max_waiting_handlers() -> None:
    book = RoundBook("peer0")
    book.register(_plan(peers(3), round_no=10))
    responder = Responder(book)
    near = Header(11, "delta", b"x" * 16, 0, 0, wait=60.0)
    keys = [f"key{i}" for i in range(MAX_WAITING // MAX_WAITING_PER_PEER)]
    waits = [
        asyncio.create_task(responder.on_fetch(key, near))
        for key in keys
        for _ in range(MAX_WAITING_PER_PEER)
    ]
    try:
        deadline = time.monotonic() + 5
        while sum(responder._waiting.values()) < MAX_WAITING:
            assert time.monotonic() < deadline, "the waits did not start"
            await asyncio.sleep(0.01)
        fresh = await asyncio.wait_for(responder.on_fetch("fresh-key", near), 1.0)
        assert fresh.code is Code.REJECTED
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def test_peers_without_a_record_neither_wait_for_a_round_nor_leave_promises() -> None:
    """With the daemon's `known` (a record at this stage lately), four fresh keys can no
    longer hold the 64 waits an honest member's early push needs, nor fill the promises."""
    book = RoundBook("peer0")
    book.register(_plan(peers(3), round_no=10))
    responder = Responder(book, known={"peer1", "peer2"}.__contains__)
    near = Header(11, "delta", b"x" * 16, 0, 0, wait=60.0)
    refused = await asyncio.wait_for(responder.on_fetch("fresh-key", near), 1.0)
    assert refused.code is Code.REJECTED and "no record" in refused.reason
    query = Header(11, "delta", b"x" * 16, 0, 1, wait=0.0)
    unpromised = await asyncio.wait_for(responder.on_query("fresh-key", query), 1.0)
    assert unpromised.code is Code.REJECTED and not book.pending
    honest = asyncio.create_task(responder.on_fetch("peer1", near))
    try:
        deadline = time.monotonic() + 5
        while responder._waiting["peer1"] < 1:  # a replica with a record still waits
            assert time.monotonic() < deadline, "the wait did not start"
            await asyncio.sleep(0.01)
        assert (await responder.on_query("peer2", query)).code is Code.NOTHING  # promised
    finally:
        honest.cancel()
        await asyncio.gather(honest, return_exceptions=True)
    assert book.unknown_rejections["no record"] == 2


def test_a_member_s_current_round_is_near_though_it_registered_nothing_near_it() -> None:
    # it mixed alone, or caught up from round 5 to 9: peers' pushes for round 9 are
    # expected, not refused as distant
    book = RoundBook("peer0")
    book.register(_plan(peers(3), round_no=5))
    assert not book.near(9)
    book.current = lambda: 9
    assert book.near(9) and book.near(10) and book.near(5) and not book.near(20)


async def test_a_stranger_filling_the_promise_table_leaves_room_for_the_backup() -> None:
    """Queries for collectives not registered yet are promises kept until registration;
    one peer's take of the table is capped, so a stranger asking without end cannot make
    an honest backup's promise go unkept (a late owner would then reduce the span too)."""
    book, members = RoundBook("peer0"), peers(3)
    responder = Responder(book)
    for i in range(3 * MAX_PENDING):
        header = Header(0, "delta", i.to_bytes(16, "big"), i % 3, 1 + i % 2)
        await responder.on_query("stranger", header)
    plan = _plan(members)
    backup = plan.owner(0, 1)
    reply = await responder.on_query(backup, Header(0, "delta", plan.group_id, 0, 1))
    assert reply.code is Code.NOTHING  # a promise made, so kept
    assert book.register(plan).spans[0].deferred == 1
    assert book.unknown_rejections["too many promises for one peer"] > 0
    refused = await responder.on_query("stranger", Header(0, "delta", b"y" * 16, 0, 1))
    assert refused.code is Code.REJECTED  # not promised: the asker is told


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


async def test_a_members_copies_of_a_part_are_refused_before_they_are_buffered() -> None:
    """One member's 32 streams of the same part were each buffered whole (96 MiB for a
    3.7 MiB frame) and each decoded and checked: a copy of a part being read, or held, is
    refused on its first chunk now, its rest read and dropped."""
    from types import SimpleNamespace

    from agora_node.comms.collective.p2p import CollectiveMessage, CollectiveServicer, _request

    members = peers(3)
    book = RoundBook("peer0")
    plan = _plan(members)
    book.register(plan)
    servicer = CollectiveServicer(Responder(book), max_frame_bytes=1 << 20)
    frame = encode_result(torch.zeros(plan.span_numel(0)), plain_format())
    header = Header(0, "delta", plan.group_id, 0, 0, weight=1.0)
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: "peer1"))
    go = asyncio.Event()

    async def stream(hold: bool):  # noqa: ANN202 - the part in two chunks
        yield _request(Code.PART, header, frame[:100], total=len(frame))
        if hold:
            await go.wait()
        yield CollectiveMessage(data=frame[100:])

    first = asyncio.create_task(servicer.rpc_push(stream(hold=True), context))
    try:
        deadline = time.monotonic() + 5
        while not servicer._reading:
            assert time.monotonic() < deadline, "the first push was not read"
            await asyncio.sleep(0.01)
        again = await asyncio.wait_for(servicer.rpc_push(stream(hold=False), context), 5)
        assert (Code(again.code), again.reason) == (Code.REJECTED, "duplicate")
        go.set()
        assert Code((await first).code) is Code.ACCEPTED
    finally:
        go.set()
        await asyncio.gather(first, return_exceptions=True)
    assert not servicer._reading
    held = await Responder(book).admit_push("peer1", header, len(frame))
    assert held is not None and held.reason == "duplicate"  # refused on its header


async def test_whole_requests_of_one_part_are_decoded_once(monkeypatch) -> None:
    """The same on the stream protocol (requests read whole, then parsed): 32 concurrent
    copies each passed the held-part check and were each hashed, checked and decoded."""
    import threading

    from agora_node.comms.collective import handlers
    from agora_node.comms.collective.p2p import CollectiveServicer, _request

    book = RoundBook("peer0")
    plan = _plan(peers(3))
    book.register(plan)
    servicer = CollectiveServicer(Responder(book), max_frame_bytes=1 << 20)
    frame = encode_result(torch.zeros(plan.span_numel(0)), plain_format())
    header = Header(0, "delta", plan.group_id, 0, 0, weight=1.0)
    whole = _request(Code.PART, header, frame, total=len(frame)).SerializeToString()
    gate, decoded, real = threading.Event(), [], handlers._read_part

    def held_open(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the first decode waits
        decoded.append(1)
        gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(handlers, "_read_part", held_open)
    first = asyncio.create_task(servicer._answer_whole("peer1", whole))
    try:
        deadline = time.monotonic() + 5
        while not decoded:
            assert time.monotonic() < deadline, "the first copy was not decoded"
            await asyncio.sleep(0.01)
        copies = await asyncio.gather(*(servicer._answer_whole("peer1", whole) for _ in range(8)))
        assert {(c.code, c.reason) for c in copies} == {(Code.REJECTED, "duplicate")}
    finally:
        gate.set()
    assert (await first).code is Code.ACCEPTED and len(decoded) == 1


async def test_a_promise_for_an_attempt_beyond_the_group_is_refused() -> None:
    """owner() takes attempts modulo the group's size: the backup's query at attempt
    1 + 3000 replaced its attempt-1 deferral and forced the owner onto fall-back."""
    book, members = RoundBook("peer0"), peers(3)
    plan = _plan(members)
    book.register(plan)
    backup = plan.owner(0, 1)
    far = await Responder(book).on_query(backup, Header(0, "delta", plan.group_id, 0, 1 + 3000))
    assert far.code is Code.REJECTED and far.reason == "not the backup"
    assert book.states[(0, "delta")].spans[0].deferred == 0


class Forging(Responder):
    """A span owner that serves a forged result (its own reduction, sign-flipped and
    tripled), naming the members it aggregated or not."""

    def __init__(self, book: RoundBook, keep_mask: bool) -> None:
        super().__init__(book)
        self.keep_mask = keep_mask

    async def on_fetch(self, sender, header):  # noqa: ANN001, ANN201
        reply = await super().on_fetch(sender, header)
        if reply.code is not Code.FINAL:
            return reply
        state = self.book.states[(header.round, header.phase)]
        value = decode_span(reply.payload, state.plan.span_numel(header.span))
        forged = encode_result(-3 * value, plain_format())
        return Reply(
            Code.FINAL, forged, reply.attempt, members=reply.members if self.keep_mask else b""
        )


@pytest.mark.parametrize("keep_mask", [True, False], ids=["names-parts", "names-none"])
@pytest.mark.parametrize("n", [2, 4])
async def test_a_forged_final_is_not_adopted(n: int, keep_mask: bool) -> None:
    """main adopted a span owner's FINAL unchecked. Here every honest member finds that the
    forger's value does not match the span's witness and keeps its own values for that
    span instead; every other span is the honest mean."""
    network = LocalNetwork()
    for p in peers(n):
        network.join(p)
    forger = "peer1"
    network.responders[forger] = Forging(network.responders[forger].book, keep_mask)
    values = random_values(n, NUMEL, seed=5)
    outs = await run_group(values, network=network, verify=True)
    mean = sum(values.values()) / n
    lo, hi = span_bounds(NUMEL, n, 64)[peers(n).index(forger)]
    for p in (p for p in peers(n) if p != forger):
        out = outs[p]
        torch.testing.assert_close(out.value[:lo], mean[:lo], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.value[hi:], mean[hi:], atol=1e-5, rtol=0)
        assert torch.equal(out.value[lo:hi], values[p][lo:hi])  # its own: nothing forged
        assert forger in out.stats.mismatched and out.stats.rejected["result mismatch"] == 1
        assert not out.consistent and out.stats.fallback_spans == 1
        assert out.own_spans == ((lo, hi),)


@pytest.mark.parametrize(
    ("codec", "feedback"),
    [(Codec.INT4, True), (Codec.TOPK4, True), (Codec.INT4, False), (Codec.BF16, False)],
    ids=["int4", "topk4", "int4-no-feedback", "bf16"],
)
async def test_a_span_that_falls_back_applies_the_own_part_as_sent(
    codec: Codec, feedback: bool
) -> None:
    """With error feedback the encoder keeps what a part left out, to send it next round.
    A span that falls back (its owner forged a result) used to take the member's exact
    values: what the encoder kept was then applied now and again later. It takes the part
    as sent, so applied + kept back = the own values there, as in every mixed span.
    Without error feedback nothing is kept: the exact values, as before."""
    n, forger = 3, "peer1"
    network = LocalNetwork()
    for p in peers(n):
        network.join(p)
    network.responders[forger] = Forging(network.responders[forger].book, keep_mask=True)
    fmt = WireFormat(part=codec, result=Codec.INT8, seed=None, error_feedback=feedback)
    encoders = {p: PartEncoder(fmt) for p in peers(n)}
    values = random_values(n, 4096, seed=7)
    outs = await run_group(
        values, network=network, verify=True, fmt=fmt, encoders=encoders, block=256
    )
    lo, hi = span_bounds(4096, n, 256)[peers(n).index(forger)]
    for p in (p for p in peers(n) if p != forger):
        out, kept = outs[p], encoders[p].take_residual()
        assert out.own_spans == ((lo, hi),)
        if feedback:
            assert kept[lo:hi].abs().sum() > 0
            torch.testing.assert_close(out.value[lo:hi] + kept[lo:hi], values[p][lo:hi])
        else:
            assert kept is None and torch.equal(out.value[lo:hi], values[p][lo:hi])


class Late(Responder):
    """A span owner that got no part in time: its result is its own part alone, and it
    names only itself (what an honest owner serves when every other part was late)."""

    async def on_fetch(self, sender, header):  # noqa: ANN001, ANN201
        reply = await super().on_fetch(sender, header)
        if reply.code is not Code.FINAL:
            return reply
        state = self.book.states[(header.round, header.phase)]
        alone = members_mask(state.plan.members, [state.plan.members[header.span]])
        return Reply(Code.FINAL, reply.payload, reply.attempt, members=alone)


@pytest.mark.parametrize("n", [2, 4])
async def test_a_result_naming_a_minority_is_not_adopted_and_nobody_is_flagged(n: int) -> None:
    """Flagging such an owner as a forger made two replicas behind NAT, whose parts went
    through a relay and were sometimes late, ban each other for the rest of the ban."""
    network = LocalNetwork()
    for p in peers(n):
        network.join(p)
    late = "peer1"
    network.responders[late] = Late(network.responders[late].book)
    values = random_values(n, NUMEL, seed=7)
    outs = await run_group(values, network=network, verify=True)
    lo, hi = span_bounds(NUMEL, n, 64)[peers(n).index(late)]
    for p in (p for p in peers(n) if p != late):
        out = outs[p]
        assert torch.equal(out.value[lo:hi], values[p][lo:hi])  # not adopted: its own
        assert not out.stats.mismatched and not out.stats.mismatch_witnesses
        assert out.stats.rejected["result names a minority"] == 1


async def test_verified_results_cost_no_mismatch_among_honest_members() -> None:
    values = random_values(5, NUMEL, seed=6)
    outs = await run_group(values, verify=True)
    assert all_equal(outs)
    for out in outs.values():
        assert out.consistent and not out.stats.mismatched and out.stats.unchecked_spans == 0
        assert out.stats.repaired_spans == 0 and out.stats.late_spans == 0
        assert out.stats.checked_spans == 4  # every other owner's span, confirmed
    torch.testing.assert_close(outs["peer0"].value, sum(values.values()) / 5, atol=1e-5, rtol=0)


def test_sketches_tell_a_forgery_from_quantization_noise() -> None:
    g = torch.Generator().manual_seed(0)
    value = torch.randn(100_000, generator=g)
    noise = value + 0.002 * torch.randn(100_000, generator=g) * value.abs().max()
    forged = value + 0.2 * value.norm() * torch.nn.functional.normalize(
        torch.randn(100_000, generator=g), dim=0
    )
    for i in range(20):
        nonce = i.to_bytes(16, "big")
        assert sketches_match(sketch(value, nonce), sketch(noise, nonce), 0.05)
        assert not sketches_match(sketch(value, nonce), sketch(forged, nonce), 0.05)


async def test_a_member_asking_its_witness_again_and_again_is_refused() -> None:
    """Each witness check costs a sketch of the span (a new set of parts a reduction): a
    member checks the one result it fetched, so the fifth check is refused."""
    members = peers(3)
    book, plan = RoundBook(members[0]), _plan(members)
    state = book.register(plan)
    span = state.witness_span()
    asker = next(m for m in members if m not in (members[0], plan.owner(span, 0)))
    header = Header(0, "delta", plan.group_id, span, 1)
    mask = members_mask(plan.members, set(members))
    responder = Responder(book)
    replies = [await responder.on_check(asker, header, b"n" * 16, mask) for _ in range(5)]
    assert [r.code for r in replies[:4]] == [Code.NOT_READY] * 4  # no witness running here
    assert replies[4].code is Code.REJECTED and state.stats.rejected["too many checks"] == 1


async def test_a_witness_out_of_checks_says_nothing_about_the_owner() -> None:
    """A member can spend a witness's reductions on masks of its own choosing; what the
    witness answers after that must read as unchecked (REJECTED), not as a part missing
    from the result (NOTHING), which would get the honest owner flagged."""
    from agora_node.comms.collective.state import WitnessBusy

    members = peers(3)
    book, plan = RoundBook(members[0]), _plan(members)
    state = book.register(plan)

    async def busy(mask: bytes, wait: float, asker: str):  # noqa: ANN202
        raise WitnessBusy("2 sets of parts checked already")

    state.witness = busy
    span = state.witness_span()
    asker = next(m for m in members if m not in (members[0], plan.owner(span, 0)))
    header = Header(0, "delta", plan.group_id, span, 1)
    reply = await Responder(book).on_check(
        asker, header, b"n" * 16, members_mask(plan.members, set(members))
    )
    assert reply.code is Code.REJECTED and "busy" in reply.reason


@pytest.mark.parametrize(
    ("block", "seed", "accepted"), [(64, 0, True), (64, 9, False), (4096, 0, False)]
)
async def test_a_part_quantized_with_a_rotation_of_its_own_choosing_is_refused(
    block: int, seed: int, accepted: bool
) -> None:
    """A member chose each part's rotation seed and block (up to 2^20): 64 distinct seeds
    pinned 256 MiB of sign vectors in the Hadamard cache and decoded 2.4x slower."""
    members = peers(3)
    book = RoundBook("peer0")
    plan = _plan(members)
    book.register(plan)
    numel = plan.span_numel(0)
    fmt = WireFormat(part=Codec.INT8, result=Codec.INT8, block=block, seed=seed)
    frame = PartEncoder(fmt).encode(torch.randn(numel), ((0, numel),))[0]
    reply = await Responder(book).on_push(
        "peer1", Header(0, "delta", plan.group_id, 0, 0, weight=1.0), frame
    )
    if accepted:
        assert reply.code == Code.ACCEPTED
    else:
        assert reply.code == Code.REJECTED and reply.reason.startswith("malformed: blocks of")
    assert torch.isfinite(decode_span(frame, numel)).all()  # our own frames: no check asked
