"""The collective in one process: exactness, codec error, failures, bad contributions."""

import asyncio
import dataclasses
import time
from functools import partial

import pytest
import torch

from agora_node.comms.collective import (
    Aggregation,
    AggregationSpec,
    LocalNetwork,
    LocalTransport,
    PartEncoder,
    Responder,
    RoundBook,
    WireFormat,
)
from agora_node.comms.collective.plan import span_bounds
from agora_node.comms.collective.state import UnknownRoundError
from agora_node.comms.collective.wire import Code, Header, Reply
from agora_node.compression import Codec, QuantizedTensor, encode_frame
from tests.outer.helpers import LOCAL, all_equal, peers, random_values, run_group

pytestmark = pytest.mark.timeout(60)
NUMEL = 3000  # not a multiple of the block: the last span has a padded block


async def test_fp32_mean_is_exact_and_identical_everywhere() -> None:
    values = random_values(3, NUMEL)
    weights = {"peer0": 1.0, "peer1": 2.0, "peer2": 5.0}
    outs = await run_group(values, weights=weights)
    expected = sum(weights[p] * values[p] for p in values) / sum(weights.values())
    assert all_equal(outs)
    torch.testing.assert_close(outs["peer0"].value, expected, rtol=0, atol=1e-6)
    assert all(o.consistent and not o.stats.failed_peers for o in outs.values())


@pytest.mark.parametrize("codec, bound", [(Codec.INT8, 0.02), (Codec.INT4, 0.12)])
async def test_codec_results_are_identical_and_within_the_codec_error(codec, bound) -> None:
    values = random_values(4, NUMEL)
    fmt = WireFormat(part=codec, result=Codec.INT8, block=64, error_feedback=True)
    outs = await run_group(values, fmt=fmt)
    expected = sum(values.values()) / 4
    assert all_equal(outs)
    err = float((outs["peer0"].value - expected).norm() / expected.norm())
    # parts: rel. error <= ~0.06 (int8) / ~0.5 (int4) each, averaged over 4; result: int8
    assert err < bound


async def test_error_feedback_makes_the_sum_of_mixes_track_the_true_sum() -> None:
    values = random_values(3, NUMEL)
    fmt = WireFormat(part=Codec.INT4, result=Codec.FP32, block=64, error_feedback=True)
    plain = WireFormat(part=Codec.INT4, result=Codec.FP32, block=64)
    expected = sum(values.values()) / 3
    totals = {}
    for name, f in (("ef", fmt), ("no_ef", plain)):
        encoders = {p: PartEncoder(f) for p in values}
        total = torch.zeros(NUMEL)
        for t in range(8):  # the same delta every round: the worst case for a biased codec
            outs = await run_group(values, fmt=f, encoders=encoders, round_no=t)
            total += outs["peer0"].value
        totals[name] = float((total - 8 * expected).norm() / (8 * expected).norm())
    assert totals["ef"] < totals["no_ef"] / 4


async def test_a_member_that_never_shows_up_is_renormalized_away() -> None:
    values = random_values(3, NUMEL)
    network = LocalNetwork()
    network.join("peer2")
    network.down.add("peer2")
    started = time.monotonic()
    outs = await run_group(values, network=network, skip={"peer2"})
    assert time.monotonic() - started < 2.0  # connection errors short-cut the deadlines
    assert all_equal(outs)
    # Every span is the mean of both survivors, the dead member's too (its backup's)
    both = (values["peer0"] + values["peer1"]) / 2
    torch.testing.assert_close(outs["peer0"].value, both, rtol=0, atol=1e-5)
    assert "peer2" in outs["peer0"].stats.failed_peers


class AnnouncingTransport(LocalTransport):
    """Sets `asked` when this member first asks another, as a span's backup, for its part."""

    def __init__(self, network: LocalNetwork, me: str, asked: asyncio.Event) -> None:
        super().__init__(network, me)
        self.asked = asked

    async def query(self, peer: str, header: Header) -> Reply:
        self.asked.set()
        return await super().query(peer, header)


async def test_a_backup_waits_for_a_member_still_encoding_its_part() -> None:
    """peer2 never shows up; peer0, its span's backup, asks peer1 for its part before peer1
    has even started (peer1 starts once asked): the answer waits for peer1's part instead of
    promising with nothing, so the span is the mean of both survivors, like every other."""
    values = random_values(3, NUMEL)
    network = LocalNetwork()
    network.join("peer2")
    network.down.add("peer2")
    asked = asyncio.Event()
    outs = await run_group(
        values,
        network=network,
        skip={"peer2"},
        transports={"peer0": AnnouncingTransport(network, "peer0", asked)},
        before={"peer1": asked.wait},
    )
    assert asked.is_set() and all_equal(outs)
    both = (values["peer0"] + values["peer1"]) / 2
    torch.testing.assert_close(outs["peer0"].value, both, rtol=0, atol=1e-5)
    assert outs["peer0"].stats.repaired_spans == 1


async def test_a_silent_member_costs_at_most_the_deadlines() -> None:
    values = random_values(3, NUMEL)
    deadlines = dataclasses.replace(LOCAL, base=0.3)
    started = time.monotonic()
    outs = await run_group(values, skip={"peer1"}, deadlines=deadlines)
    elapsed = time.monotonic() - started
    assert all_equal(outs) and all(o.consistent for o in outs.values())
    torch.testing.assert_close(outs["peer0"].value, (values["peer0"] + values["peer2"]) / 2)
    assert elapsed < deadlines.worst_case(NUMEL, 3, WireFormat())


class DeafNetwork(LocalNetwork):
    """`deaf` members can send but nobody reaches them: as if they died right after pushing."""

    def __init__(self, deaf: set[str]) -> None:
        super().__init__()
        self.deaf = deaf

    def responder(self, sender: str, peer: str):
        if peer in self.deaf:
            raise ConnectionError(f"{peer} is gone")
        return super().responder(sender, peer)


async def test_dead_reducer_span_is_re_reduced_and_survivors_agree() -> None:
    values = random_values(3, NUMEL)
    network = DeafNetwork({"peer2"})

    def state(me: str):
        return network.responders[me].book.states[(0, "delta")]

    async def after_peer2_pushed(me: str) -> None:
        span = state(me).spans[state(me).my_index]
        assert await state(me).changed.wait_for(lambda: "peer2" in span.parts, 5.0)

    async def after_peer1_contributes() -> None:
        # peer0 is the backup of peer2's span: let it ask once peer1 has something to give
        await after_peer2_pushed("peer0")
        assert await state("peer1").changed.wait_for(lambda: state("peer1").my_values, 5.0)

    before = {"peer0": after_peer1_contributes, "peer1": partial(after_peer2_pushed, "peer1")}
    outs = await run_group(values, network=network, before=before)
    survivors = {p: outs[p] for p in ("peer0", "peer1")}
    assert all_equal(survivors)
    value = survivors["peer0"].value
    full = sum(values.values()) / 3
    pair = (values["peer0"] + values["peer1"]) / 2
    spans = dict(zip(values, span_bounds(NUMEL, 3, 64), strict=True))
    for p, (lo, hi) in spans.items():
        # peer2's parts reached the others' spans; its own span was re-reduced without it
        expected = pair if p == "peer2" else full
        torch.testing.assert_close(value[lo:hi], expected[lo:hi], rtol=0, atol=1e-6)
    assert sum(o.stats.repaired_spans for o in survivors.values()) == 1
    # peer2's span came to each survivor from a later attempt than its first owner's
    assert [survivors[p].stats.late_spans for p in ("peer0", "peer1")] == [1, 1]


class DiesAfterPushingTo(LocalTransport):
    """Delivers its pushes one at a time in the order it makes them (as one connection
    would), and dies, its later calls failing and nobody reaching it, right after its part
    of `span` has reached the span's owner: a member killed in the middle of its pushes."""

    def __init__(self, network: LocalNetwork, me: str, span: int, died: asyncio.Event) -> None:
        super().__init__(network, me)
        self.span, self.died, self.turn = span, died, asyncio.Lock()

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply:
        async with self.turn:
            reply = await super().push(peer, header, payload)
            if (header.span, header.attempt) == (self.span, 0):
                self.network.down.add(self.me)
                self.died.set()
            return reply


async def test_a_member_killed_mid_push_leaves_results_its_witness_can_check() -> None:
    """peer2 dies right after its part of span 0 reached the span's owner (peer0). Before,
    its copy for the span's witness (peer1) was pushed alongside and could be lost with it
    (the integration test caught it): peer0's result then named a part peer1 never got,
    peer1 refused it and kept its own values for the span while peer0 kept the result, and
    peer0, honest, was flagged. The witness copy now goes first: the two agree."""
    values = random_values(3, NUMEL)
    network, died = LocalNetwork(), asyncio.Event()
    transports = {"peer2": DiesAfterPushingTo(network, "peer2", 0, died)}
    before = {p: died.wait for p in ("peer0", "peer1")}
    outs = await run_group(
        values, network=network, transports=transports, before=before, verify=True
    )
    survivors = [outs["peer0"], outs["peer1"]]
    assert torch.equal(survivors[0].value, survivors[1].value)
    lo, hi = span_bounds(NUMEL, 3, 64)[0]
    full = sum(values.values()) / 3  # peer2's part of span 0 was in and was checked
    torch.testing.assert_close(survivors[0].value[lo:hi], full[lo:hi], rtol=0, atol=1e-5)
    for out in survivors:
        assert out.consistent and not out.stats.mismatched and not out.stats.fallback_spans
    assert sum(o.stats.repaired_spans for o in survivors) == 1  # peer2's own span


class CannotReach(LocalTransport):
    def __init__(self, network: LocalNetwork, me: str, unreachable: str) -> None:
        super().__init__(network, me)
        self.unreachable = unreachable

    async def fetch(self, peer: str, header: Header) -> Reply:
        if peer == self.unreachable:
            raise ConnectionError("link down")
        return await super().fetch(peer, header)


async def test_a_result_seen_by_some_is_adopted_not_recomputed() -> None:
    """peer1 cannot fetch peer2's span; its backup finds the value at a member that has it."""
    values = random_values(3, NUMEL)
    network = LocalNetwork()
    outs = await run_group(
        values, network=network, transports={"peer1": CannotReach(network, "peer1", "peer2")}
    )
    assert all_equal(outs) and all(o.consistent for o in outs.values())
    # span 2 was reduced by peer2 with every part; peer1 got it through the backup
    lo = span_bounds(NUMEL, 3, 64)[2][0]
    expected = (sum(values.values()) / 3)[lo:]
    torch.testing.assert_close(outs["peer1"].value[lo:], expected, rtol=0, atol=1e-6)


def forged(kind: str, header: Header, payload: bytes, numel: int) -> tuple[Header, bytes]:
    def fp32(t: torch.Tensor, dtype=torch.float32) -> bytes:
        return encode_frame(
            QuantizedTensor(Codec.FP32, tuple(t.shape), dtype, t.reshape(-1).float())
        )

    if kind == "wrong shape":
        return header, fp32(torch.ones(numel + 1))
    if kind == "wrong dtype":
        return header, fp32(torch.ones(numel), torch.float16)
    if kind == "nan":
        return header, fp32(torch.full((numel,), float("nan")))
    if kind == "oversized":
        return header, payload + bytes(4 * numel + 100)
    if kind == "wrong round":
        return dataclasses.replace(header, round=header.round + 7, wait=0.0), payload
    if kind == "negative weight":
        return dataclasses.replace(header, weight=-5.0), payload
    raise ValueError(kind)


class Forger(LocalTransport):
    def __init__(self, network: LocalNetwork, me: str, kind: str, numel: int) -> None:
        super().__init__(network, me)
        self.kind, self.numel = kind, numel

    async def push(self, peer: str, header: Header, payload: bytes) -> Reply:
        header, payload = forged(self.kind, header, payload, self.numel)
        return await super().push(peer, header, payload)


@pytest.mark.parametrize(
    "kind", ["wrong shape", "wrong dtype", "nan", "oversized", "wrong round", "negative weight"]
)
async def test_malformed_contributions_are_rejected_counted_and_do_not_stall(kind: str) -> None:
    values = random_values(3, 3 * 1024)
    network = LocalNetwork()
    started = time.monotonic()
    outs = await run_group(
        values, network=network, transports={"peer2": Forger(network, "peer2", kind, 1024)}
    )
    elapsed = time.monotonic() - started
    assert all_equal(outs)
    value = outs["peer0"].value
    honest = (values["peer0"] + values["peer1"]) / 2
    full = sum(values.values()) / 3
    torch.testing.assert_close(value[:2048], honest[:2048], rtol=0, atol=1e-6)
    torch.testing.assert_close(value[2048:], full[2048:], rtol=0, atol=1e-6)  # its own span
    if kind == "wrong round":
        # 7 rounds ahead: refused at once as distant (a near one would wait for its round)
        assert network.responders["peer0"].book.unknown_rejections["distant round"] == 1
    else:
        counted = sum(sum(outs[p].stats.rejected.values()) for p in ("peer0", "peer1"))
        assert counted >= 2
        assert elapsed < 1.0  # a refused member is not waited for


async def test_centered_clip_in_the_collective_bounds_a_scaled_member() -> None:
    values = random_values(4, NUMEL, seed=3)
    values["peer3"] = values["peer3"] * 1000
    spec = AggregationSpec(method=Aggregation.CENTERED_CLIP)
    outs = await run_group(values, aggregation=spec)
    assert all_equal(outs)
    honest = sum(values[p] for p in peers(3)) / 3
    radii = [r for o in outs.values() for r in o.stats.clip_radii]
    bound = sum(r * r for r in radii) ** 0.5
    assert float((outs["peer0"].value - honest).norm()) <= bound
    assert float(outs["peer0"].value.norm()) < 2 * float(honest.norm()) + bound


async def test_late_member_adopts_the_groups_result() -> None:
    """A member that starts after the others finished gets their values, not its own."""
    values = random_values(3, NUMEL)
    network = LocalNetwork()
    quick = dataclasses.replace(LOCAL, base=0.3)
    early = await run_group(values, network=network, skip={"peer2"}, deadlines=quick)
    late = await run_group(values, network=network, skip={"peer0", "peer1"}, deadlines=quick)
    assert torch.equal(late["peer2"].value, early["peer0"].value)
    assert late["peer2"].consistent


async def test_a_query_about_an_unregistered_round_is_answered_with_a_promise() -> None:
    # The responder tells "unknown round" from other refusals by its type, not its text.
    book = RoundBook("peer0")
    with pytest.raises(UnknownRoundError):
        await book.lookup(7, "delta", b"g", wait=0)
    header = Header(round=7, phase="delta", group_id=b"g", span=1, attempt=2)
    assert (await Responder(book).on_query("peer1", header)).code is Code.NOTHING
    assert book.pending[(7, "delta", b"g")] == {(1, "peer1"): 2}
    pushed = await Responder(book).on_push("peer1", header, b"")
    assert (pushed.code, pushed.reason) == (Code.REJECTED, "unknown round")


@pytest.mark.parametrize("attack", ["scaled 1000x", "sign-flipped"])
async def test_the_daemons_aggregation_bounds_one_byzantine_of_five(attack: str) -> None:
    """With the aggregation the daemon builds from the manifest (main: plain mean), one
    replica of five sending a 1000x or sign-flipped delta barely moves the honest result."""
    from agora_node.node.outer_state import OuterConfig
    from agora_node.stages.manifest_files import load_manifest

    spec = OuterConfig.from_manifest(load_manifest("tiny")).aggregation
    g = torch.Generator().manual_seed(11)
    common = torch.randn(NUMEL, generator=g)
    values = {p: common + 0.3 * torch.randn(NUMEL, generator=g) for p in peers(5)}
    honest = sum(values[p] for p in peers(4)) / 4
    values["peer4"] = values["peer4"] * (1000 if attack == "scaled 1000x" else -1)
    outs = await run_group(values, aggregation=spec)
    assert all_equal(outs)
    for p in peers(4):
        assert float((outs[p].value - honest).norm()) < 0.2 * float(honest.norm())
    if attack == "scaled 1000x":  # refused by norm, and counted by the reducers
        refused = sum(o.stats.rejected["norm out of range"] for o in outs.values())
        assert refused >= 4
        assert {p for o in outs.values() for p in o.stats.outliers} == {"peer4"}


@pytest.mark.parametrize("method", [Aggregation.MEAN, Aggregation.CENTERED_CLIP])
async def test_a_span_reduces_to_the_same_bits_whatever_order_its_parts_arrived_in(method):
    """Float sums depend on their order: a reducer sums in member order, so a result (and
    a benchmark's loss) does not depend on which part came first."""
    from agora_node.comms.collective import AllReduce, GroupPlan, plain_format
    from agora_node.comms.collective.state import Contribution

    values = random_values(6, NUMEL, seed=3)
    members = tuple(values)
    plan = GroupPlan(round=0, phase="delta", members=members, numel=NUMEL, block=64)
    network = LocalNetwork()
    state = network.join(members[0]).register(plan)
    run = AllReduce(
        state,
        network.transport(members[0]),
        fmt=plain_format(),
        encoder=PartEncoder(plain_format()),
        aggregation=AggregationSpec(method=method),
        deadlines=LOCAL,
    )
    parts = {p: Contribution(weight=1.0 + k / 7, value=v, frame=b"") for k, (p, v) in enumerate(values.items())}  # fmt: skip
    results = []
    for order in (list(members), list(reversed(members)), sorted(members, key=hash)):
        final = await run._aggregate_final(0, [parts[p] for p in order], 0, order, count=False)
        results.append(final.value)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_a_backup_re_issues_the_value_most_members_hold_not_the_latest_claimed() -> None:
    """Members answer a backup's query with the finals they hold; one claiming a later
    attempt for a made-up value decided the span before (it took the highest attempt)."""
    from agora_node.comms.collective.backup import most_held
    from agora_node.comms.collective.state import Final

    honest = Final(b"a", 0, torch.zeros(1))
    liar = Final(b"b", 7, torch.ones(1))
    assert most_held([honest, liar, honest]).frame == b"a"
    assert most_held([liar, honest, Final(b"a", 1, torch.zeros(1))]).frame == b"a"
    later = Final(b"c", 2, torch.ones(1))
    assert most_held([honest, later]) is later  # a tie goes to the later attempt, as before
