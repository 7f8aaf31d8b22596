"""Canary micro-batches (node/canary.py): who departs from the strict majority, the probe
answer of a stage, and a sender flagging a replica whose output departs (no network)."""

import asyncio
import logging

import pytest
import torch

from agora_node.comms import streams
from agora_node.comms.pipeline_wire import (
    Code,
    ForwardHeader,
    ResponseHeader,
    Status,
    decode_forward,
    decode_response,
    encode_forward,
    encode_response,
)
from agora_node.node.canary_rules import (
    GRAD_TOLERANCE,
    NOISE_CHECKS,
    NoiseWatch,
    best_cosines,
    departing,
    distance,
    grad_distance,
)
from agora_node.node.pipeline import Pipeline, PipelineConfig
from agora_node.node.suspects import Reason
from agora_node.node.worker import StageWorker
from agora_node.stages.data import TokenBatch
from agora_node.stages.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(60)


def test_the_replica_far_from_an_agreeing_majority_departs() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    near = {"a": x, "b": x * 1.02, "c": x + 0.01}
    assert departing(near, 0.1) == []
    assert departing({**near, "d": -x}, 0.1) == ["d"]
    assert departing({"a": x, "b": x * 1.02, "c": x * 10}, 0.1) == ["c"]
    assert departing({"a": x, "b": x * 1.02, "c": torch.full_like(x, float("nan"))}, 0.1) == ["c"]
    # two colluders agreeing with each other are still far from the honest majority
    liars = {"x": x * 5, "y": x * 5.01}
    assert departing({**near, **liars}, 0.1) == ["x", "y"]
    # no strict majority agrees: nobody is flagged; with two answers, nobody either
    assert departing({"a": x, "b": -x, "c": 3 * x}, 0.1) == []
    assert departing({"a": x, "b": -x}, 0.1) == []
    assert distance(x, x[:10]) == float("inf")
    # of a stage of five, two agreeing answers and one other are no strict majority
    colluders = {"x": x * 5, "y": x * 5.01, "h": x}
    assert departing(colluders, 0.1) == ["h"]  # as a majority of the three answers
    assert departing(colluders, 0.1, of=5) == []
    assert departing({**colluders, "a": x, "b": x * 1.02}, 0.1, of=5) == ["x", "y"]


def _stage_pipeline(stage: int, peers: list[str], **config) -> Pipeline:
    m = load_manifest("tiny")
    worker = StageWorker(m, stage)
    return Pipeline(m, worker, None, "me", lambda s: list(peers), PipelineConfig(**config))


def _inputs(p: Pipeline, stage: int):
    m = p.manifest
    b, s, w = m.inner.micro_batch, m.model.seq_len, p.worker.stage.boundary_width
    header = ForwardHeader(run_id=m.run_id, mb_id="x", stage=stage, batch=b, seq=s, width=w)
    tokens = torch.randint(0, m.model.vocab_size, (b, s + 1), generator=torch.Generator())
    return header, tokens, torch.randn(b, s, w) * 0.1


def test_a_probe_is_answered_with_the_stages_output_and_nothing_downstream() -> None:
    p = _stage_pipeline(1, [])
    try:
        header, tokens, c = _inputs(p, 1)
        probe = ForwardHeader(**{**header.__dict__, "train": False, "probe": True})
        data = encode_forward(probe, tokens, p.codec.encode(c))

        async def ask() -> bytes:
            return b"".join([chunk async for chunk in p.handle("prober", data)])

        reply, payload = decode_response(asyncio.run(ask()))
        assert reply.status == Status.OK.value
        out = p.codec.decode(payload, (header.batch, header.seq, header.width))
        expected = p.worker.forward_eval(c, tokens)
        assert torch.allclose(out, expected, atol=0.05, rtol=0.05)
        assert p.worker.in_flight == 0  # nothing kept for a backward
    finally:
        p.worker.close()


def test_a_sender_flags_the_replica_whose_canary_output_departs(monkeypatch) -> None:
    p = _stage_pipeline(0, ["good-1", "good-2", "bad"], canary_every=1)
    try:
        header, tokens, c = _inputs(p, 1)
        truth = torch.randn(header.batch, header.seq, header.width)
        outputs = {"good-1": truth, "good-2": truth * 1.01, "bad": -truth}
        probes: list[str] = []

        async def request(p2p, peer, protocol, payload, *, timeout, **_kw):  # noqa: ANN001, ANN202
            sent, *_ = decode_forward(payload)
            if sent.probe:
                probes.append(peer)
                return encode_response(
                    ResponseHeader(status=Status.OK.value), p.codec.encode(outputs[peer])
                )
            grad = torch.zeros(header.batch, header.seq, header.width)
            return encode_response(
                ResponseHeader(status=Status.OK.value, loss=2.0), p.codec.encode(grad)
            )

        monkeypatch.setattr(streams, "request", request)

        async def go() -> None:
            assert await p.send(header, TokenBatch(tokens), c) is not None
            await asyncio.wait_for(asyncio.gather(*p.canaries.tasks), 30)

        asyncio.run(go())
        assert sorted(probes) == ["bad", "good-1", "good-2"]
        assert p.suspects.banned() == {"bad"}
        (row,) = p.suspects.status()["banned"]
        assert row["reason"] == Reason.CANARY.value
        assert p.canaries.counts == {
            "sent": 1, "compared": 1, "flagged": 1, "too_many_replicas": 0, "trained": 0
        }  # fmt: skip
    finally:
        p.worker.close()


def test_two_colluders_of_five_get_no_honest_replica_flagged(monkeypatch) -> None:
    """Canaries asked 3 of a stage's replicas and judged by the majority of those 3: two
    colluders of five, answering the same made-up output whenever both were asked, were
    that majority and got each honest replica banned in turn (then carried the stream).
    Now each probe asks a strict majority of the stage and one more, judged against it."""
    honest, colluders = ["h1", "h2", "h3"], ["c1", "c2"]
    p = _stage_pipeline(0, honest + colluders, canary_every=1)
    try:
        header, tokens, c = _inputs(p, 1)
        truth = torch.randn(header.batch, header.seq, header.width)
        asked: list[int] = []

        async def request(p2p, peer, protocol, payload, *, timeout, **_kw):  # noqa: ANN001, ANN202
            sent, *_ = decode_forward(payload)
            if sent.probe:
                asked.append(peer)
                out = truth if peer in honest else torch.zeros_like(truth)
                return encode_response(ResponseHeader(status=Status.OK.value), p.codec.encode(out))
            grad = torch.zeros(header.batch, header.seq, header.width)
            return encode_response(
                ResponseHeader(status=Status.OK.value, loss=2.0), p.codec.encode(grad)
            )

        monkeypatch.setattr(streams, "request", request)
        # the draw the colluders wait for (3 in 10 with samples of 3): both of them asked
        from agora_node.node import canary

        colluders_first = lambda peers, k: sorted(peers, key=lambda q: q not in colluders)[:k]  # noqa: E731
        monkeypatch.setattr(canary.random, "sample", colluders_first)

        async def go() -> None:
            for _ in range(12):
                await p.send(header, TokenBatch(tokens), c)
                await asyncio.wait_for(asyncio.gather(*p.canaries.tasks), 30)

        asyncio.run(go())
        assert not p.suspects.banned() & set(honest)
        assert p.canaries.counts["compared"] == 12
        assert p.suspects.banned() <= set(colluders)
        assert sorted(asked[:4]) == ["c1", "c2", "h1", "h2"]  # a strict majority and one
    finally:
        p.worker.close()


def test_gradients_are_compared_by_direction_and_size() -> None:
    g = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    drift = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2))
    assert grad_distance(g, g) == pytest.approx(0.0, abs=1e-6)
    assert grad_distance(g, g + 0.5 * drift) < GRAD_TOLERANCE  # an honest replica's drift
    assert grad_distance(g, -g) == pytest.approx(2.0)  # sign flipped: same norm
    assert grad_distance(g, 40 * g) > GRAD_TOLERANCE  # 40x the size
    assert grad_distance(g, torch.zeros_like(g)) == float("inf")
    assert grad_distance(g, 25 * g) < GRAD_TOLERANCE < grad_distance(g, 35 * g)
    assert grad_distance(g, torch.full_like(g, float("nan"))) == float("inf")
    grads = {"a": g, "b": g + 0.5 * drift, "c": g - 0.4 * drift, "liar": -g}
    assert departing(grads, GRAD_TOLERANCE, far=grad_distance) == ["liar"]


def _with_cosine(g: torch.Tensor, cosine: float, seed: int) -> torch.Tensor:
    """A vector of g's norm at `cosine` from g."""
    r = torch.randn(g.shape, generator=torch.Generator().manual_seed(seed))
    r = r - (r.flatten() @ g.flatten()) / g.norm() ** 2 * g  # orthogonal to g
    return g * cosine + r / r.norm() * g.norm() * (1 - cosine**2) ** 0.5


def test_a_replica_answering_noise_is_caught_over_several_checks_the_honest_are_not() -> None:
    """A gradient of noise with a plausible norm (cosine near 0 with everyone's) passes one
    check (honest replicas after many inner steps come near 0.2); over NOISE_CHECKS checks
    its best cosine stays near 0, the lowest honest replica's does not."""
    watch = NoiseWatch()
    flagged = []
    for k in range(3 * NOISE_CHECKS):
        g = torch.randn(8, 128, 16, generator=torch.Generator().manual_seed(k))
        grads = {
            "h1": g,
            "h2": _with_cosine(g, 0.9, 100 + k),
            "low": _with_cosine(g, 0.2, 200 + k),  # the lowest honest pair measured
            "noise": torch.randn(g.shape, generator=torch.Generator().manual_seed(300 + k)),
        }
        cosines = best_cosines(grads, need=3)  # a strict majority of four
        assert cosines["noise"] < 0.05 < 0.15 < cosines.get("low", 1.0)
        flagged += watch.noisy(cosines)
    assert flagged == ["noise"] * 3  # every NOISE_CHECKS checks, then its record starts over
    # two colluders answering one made-up vector while the honest replica asked was busy
    # are no strict majority of a stage of four: the honest one is not judged
    made_up = torch.randn(g.shape)
    minority = {"h1": grads["h1"], "l1": made_up, "l2": made_up.clone()}
    assert best_cosines(minority, need=3) == {}
    assert "h1" in best_cosines(minority, need=2)  # (as in a stage of three)
    # two of three answering noise leave no agreeing pair to judge the third against
    g = torch.randn(8, 128, 16)
    two_noisy = {"h": g, "n1": torch.randn(g.shape), "n2": torch.randn(g.shape)}
    assert best_cosines(two_noisy) == {}
    # a zero or non-finite gradient is left to `departing` (far from everyone)
    with_zero = {"h": g, "h2": g, "h3": g, "z": torch.zeros_like(g)}
    assert best_cosines(with_zero, need=2) == pytest.approx({"h": 1.0, "h2": 1.0, "h3": 1.0})


def test_the_noise_watch_keeps_a_bounded_record() -> None:
    watch = NoiseWatch()
    for k in range(1000):
        watch.noisy({f"p{k}": 0.0})
    assert len(watch.seen) == 256 and "p999" in watch.seen


@pytest.mark.parametrize("lie", ["flip", "loss", "noise", "none"])
def test_the_last_stage_is_checked_with_training_micro_batches_a_liar_cannot_tell(
    monkeypatch, lie
) -> None:
    """A replica of the last stage that negated the gradients it returned (their norm
    unchanged) or reported a made-up loss was never caught: canaries were forward-only
    probes marked as such, which a liar answered honestly. Now the last stage's checks are
    training micro-batches like any other, compared on their loss and gradient."""
    honest, liar = ["h1", "h2", "h3"], "liar"
    p = _stage_pipeline(2, [*honest, liar], canary_every=1)
    try:
        header, tokens, c = _inputs(p, 3)
        header = ForwardHeader(**{**header.__dict__, "mb_id": "0123456789abcdef"})
        g = torch.Generator().manual_seed(3)
        truth = torch.randn(header.batch, header.seq, header.width, generator=g) * 0.01
        seen: list[ForwardHeader] = []

        async def request(p2p, peer, protocol, payload, *, timeout, **_kw):  # noqa: ANN001, ANN202
            sent, *_ = decode_forward(payload)
            seen.append(sent)
            grad = truth + 0.003 * torch.randn(truth.shape, generator=g)
            loss = 2.0 + 0.01 * float(torch.rand(1, generator=g))
            if peer == liar and lie == "flip":
                grad = -grad
            if peer == liar and lie == "loss":
                loss = 0.01
            if peer == liar and lie == "noise":  # a plausible norm, no direction
                grad = torch.randn(truth.shape, generator=g) * float(truth.std())
            return encode_response(
                ResponseHeader(status=Status.OK.value, loss=loss), p.codec.encode(grad)
            )

        monkeypatch.setattr(streams, "request", request)

        async def go() -> None:
            for _ in range(6):
                await p.send(header, TokenBatch(tokens), c)
                await asyncio.wait_for(asyncio.gather(*p.canaries.tasks), 30)

        asyncio.run(go())
        assert p.suspects.banned() == ({liar} if lie != "none" else set())
        assert p.canaries.counts["compared"] >= 1 and p.canaries.counts["trained"] >= 3
        # every request looked like training: no probe flag, no marked id, ids of one length
        assert all(s.train and not s.probe for s in seen)
        assert {len(s.mb_id) for s in seen} == {16} and len({s.mb_id for s in seen}) > 1
        assert not any("canary" in s.mb_id for s in seen)
    finally:
        p.worker.close()


def test_checks_are_drawn_at_random_and_none_starts_after_a_leave(monkeypatch) -> None:
    """Every 64th answer was checked, counted from the pipeline's start: a liar that
    counted its answers lied on all the others, never caught. And micro-batches finishing
    after a leave's cancel still sent copies to other replicas."""
    p = _stage_pipeline(2, ["a", "b", "c"], canary_every=4)
    try:
        draws = [p.canaries._due() for _ in range(4000)]
        assert 800 < sum(draws) < 1200  # one in four on average
        assert draws[3::4] != [True] * 1000  # not every 4th
        p.canaries.cancel()
        assert not any(p.canaries._due() for _ in range(100))
    finally:
        p.worker.close()


@pytest.mark.parametrize("flagged_before", [False, True])
def test_a_head_sending_noise_as_activations_is_caught_by_the_next_stage(
    monkeypatch, caplog, flagged_before
) -> None:
    """A head that sent noise of a plausible norm instead of its activations poisoned the
    next stage's training, caught by nothing (a QA run: the honest head's loss rose 1.45
    -> 2.2-2.7): nobody but stage 0's replicas can recompute them, and nobody asked. Now a
    replica of stage 1 has other heads recompute one micro-batch in `canary_every` it
    trains on, and refuses a head caught departing from them. A head already banned for a
    norm outlier (whose other micro-batches are still taken) is checked as well: it was
    skipped as untrusted, and its noise trained on."""
    caplog.set_level(logging.DEBUG, "agora_node.node.canary")  # its distances logged too
    m = load_manifest("demo")  # two stages: stage 1 trains without a downstream
    head = StageWorker(m, 0)
    p = Pipeline(
        m, StageWorker(m, 1), None, "me", lambda s: ["h1", "h2", "h3", "liar"] if s == 0 else [],
        PipelineConfig(canary_every=1),
    )  # fmt: skip
    try:
        b, s, w = m.inner.micro_batch, m.model.seq_len, p.worker.stage.boundary_width
        tokens = torch.randint(0, m.model.vocab_size, (b, s + 1), generator=torch.Generator())
        truth = head.forward_eval(None, tokens)
        probed: list[ForwardHeader] = []

        async def request(p2p, peer, protocol, payload, *, timeout, **_kw):  # noqa: ANN001, ANN202
            sent, _, _, activations = decode_forward(payload)
            assert sent.probe and sent.stage == 0 and not len(activations)
            probed.append(sent)
            return encode_response(ResponseHeader(status=Status.OK.value), p.codec.encode(truth))

        monkeypatch.setattr(streams, "request", request)

        def train(c: torch.Tensor, n: int) -> bytes:
            header = ForwardHeader(
                run_id=m.run_id, mb_id=f"mb{n:014d}", stage=1, batch=b, seq=s, width=w,
                loss_scale=m.inner.micro_batch / m.inner.local_batch,
            )  # fmt: skip
            return encode_forward(header, tokens, p.codec.encode(c))

        async def answer(sender: str, data: bytes) -> ResponseHeader:
            reply = b"".join([chunk async for chunk in p.handle(sender, data)])
            await asyncio.wait_for(asyncio.gather(*p.canaries.tasks), 30)
            return decode_response(reply)[0]

        async def go() -> None:
            noise = torch.randn(truth.shape) * truth.std()
            if flagged_before:
                p.suspects.flag("liar", Reason.PIPELINE_OUTLIER, "activations: norm outlier")
            assert (await answer("h1", train(truth, 1))).status == Status.OK.value
            assert (await answer("liar", train(noise, 2))).status == Status.OK.value
            assert p.suspects.reason_of("liar") != Reason.CANARY  # one departure: not yet
            assert (await answer("liar", train(noise, 3))).status == Status.OK.value
            refused = await answer("liar", train(noise, 4))  # caught: refused from now on
            assert refused.status == Status.REJECTED.value and "banned" in refused.message
            assert (await answer("h2", train(truth, 5))).status == Status.OK.value

        asyncio.run(go())
        assert p.suspects.banned() == {"liar"}
        (row,) = p.suspects.status()["banned"]
        assert row["reason"] == Reason.CANARY.value and "twice in a row" in row["evidence"]
        assert p.canaries.counts["compared"] == 4 and p.canaries.counts["flagged"] == 1
        # each check asks a strict majority of the heads and one more, the sender among
        # them: 3 others of 4, then 2 of 3 once the liar is banned as a canary (a norm
        # outlier's ban leaves it checked and asked)
        assert len(probed) == 3 + 3 + 3 + 2
    finally:
        head.close()
        p.worker.close()


def test_a_head_answers_probes_of_stage_0_from_stage_1_only() -> None:
    """Heads took no requests at all; now a probe of stage 0 (its tokens, no activations)
    from a peer with a record at stage 1, answered with the head's output."""
    m = load_manifest("demo")
    p = Pipeline(
        m, StageWorker(m, 0), None, "me", lambda s: [], PipelineConfig(),
        may_send=lambda peer, stage: (peer, stage) == ("stage-1", 1),
    )  # fmt: skip
    try:
        b, s, w = m.inner.micro_batch, m.model.seq_len, p.worker.stage.boundary_width
        tokens = torch.randint(0, m.model.vocab_size, (b, s + 1), generator=torch.Generator())
        header = ForwardHeader(run_id=m.run_id, mb_id="x/canary", stage=0, batch=b, seq=s, width=w)
        probe = ForwardHeader(**{**header.__dict__, "train": False, "probe": True})
        trains = ForwardHeader(**{**header.__dict__, "train": True, "probe": True})

        async def ask(sender: str, data: bytes) -> tuple[ResponseHeader, memoryview]:
            return decode_response(b"".join([chunk async for chunk in p.handle(sender, data)]))

        async def go() -> None:
            reply, out = await ask("stage-1", encode_forward(probe, tokens, b""))
            assert reply.status == Status.OK.value
            decoded = p.codec.decode(out, (b, s, w))
            assert torch.allclose(decoded, p.worker.forward_eval(None, tokens), atol=0.05)
            busy, rejected = Status.BUSY.value, Status.REJECTED.value
            for sender, data, status, words in [
                ("stranger", encode_forward(probe, tokens, b""), busy, "no record at stage 1"),
                ("stage-1", encode_forward(header, tokens, b""), busy, "serves stage 0"),  # train
                ("stage-1", encode_forward(probe, tokens, b"\0" * 8), rejected, "no activations"),
                # a probe that says it trains (it crashed the handler: no activations to check)
                ("stage-1", encode_forward(trains, tokens, b""), busy, "serves stage 0"),
            ]:
                refused, _ = await ask(sender, data)
                assert (refused.status, words in refused.message) == (status, True), refused

            # a budget per sender: 4 at once, then one a second (it had none: Sybils with
            # records at stage 1 had heads compute for them without end)
            answers = [await ask("stage-1", encode_forward(probe, tokens, b"")) for _ in range(4)]
            assert [reply.status for reply, _ in answers].count(Status.OK.value) <= 3
            assert answers[-1][0].code == Code.OVERLOADED.value

        asyncio.run(go())
        assert p.worker.in_flight == 0
    finally:
        p.worker.close()
