"""Fuzzed requests into the real handlers, in process (issue 10): each answers with an
error response (or drops and counts the message) rather than raising.

Covered: the pipeline's forward handler (a real StageWorker of a small last stage), the
collective's Responder and its libp2p servicer, the state server behind its stream
framing, the SWIM state machine, round-entry reads and directory reads. Examples per
test: tests/fuzz/mutations.py (AGORA_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

from agora_node.comms import state_transfer, streams
from agora_node.comms.collective import GroupPlan, RoundBook
from agora_node.comms.collective.groups import Matchmaker, MatchmakingConfig, MemoryBoard
from agora_node.comms.collective.handlers import Responder
from agora_node.comms.collective.p2p import CollectiveMessage, CollectiveServicer, _read_reply
from agora_node.comms.collective.payload import WireFormat, encode_result, max_frame_bytes
from agora_node.comms.collective.wire import Code, Header, Reply
from agora_node.comms.directory import Directory
from agora_node.comms.membership.messages import MemberMeta
from agora_node.comms.membership.signing import Ed25519Verifier, null_verify
from agora_node.comms.membership.swim import Membership
from agora_node.comms.pipeline_wire import Code as Code_
from agora_node.comms.pipeline_wire import (
    ForwardHeader,
    ResponseHeader,
    Status,
    decode_response,
    encode_forward,
    encode_response,
    encode_tokens,
    error_response,
)
from agora_node.compression import ActivationCodec, Codec
from agora_node.node import pipeline as pipeline_module
from agora_node.node.config import PipelineConfig
from agora_node.node.pipeline import Pipeline
from agora_node.node.worker import StageWorker
from agora_node.protocol.identity import verify as verify_signature
from agora_node.protocol.manifest import parse_manifest
from agora_node.protocol.names import outer_round_key
from agora_node.protocol.records import NodeRecord
from agora_node.stages.manifest_files import load_manifest
from tests.fuzz.mutations import FUZZ, HUGE_INTS, ODD_FLOATS, TIMEOUT_S, field_edits, mutated
from tests.fuzz.test_decoders import (
    ALICE,
    ENVELOPES,
    FRAMES,
    frame_edits,
    seal_frame,
    signed_values,
)

pytestmark = pytest.mark.timeout(TIMEOUT_S)


def _small_manifest(stages: int = 2):
    """tiny, shrunk so that a forward and backward of one micro-batch take milliseconds."""
    text = load_manifest("tiny").to_toml()
    for old, new in [
        ("d_model = 256", "d_model = 32"),
        ("n_layers = 8", f"n_layers = {stages}"),
        ("n_heads = 8", "n_heads = 2"),
        ("n_kv_heads = 4", "n_kv_heads = 1"),
        ("ffn_dim = 704", "ffn_dim = 64"),
        ("seq_len = 128", "seq_len = 8"),
        ("subspace_rank = 32", "subspace_rank = 4"),
        ("count = 4", f"count = {stages}"),
        ("micro_batch = 8", "micro_batch = 2"),
        ("local_batch = 16", "local_batch = 2"),
    ]:
        assert old in text, old
        text = text.replace(old, new)
    return parse_manifest(text)


# ---- the pipeline's forward handler (node/pipeline.py) ----------------------------------

MANIFEST = _small_manifest()
SEQ, WIDTH = MANIFEST.model.seq_len, MANIFEST.model.subspace_rank


@pytest.fixture(scope="module")
def last_stage():
    worker = StageWorker(MANIFEST, 1)  # the last of two stages: answers without sending on
    try:
        yield worker
    finally:
        worker.close()


def _request(batch: int, mode: str, train: bool = True) -> bytes:
    header = ForwardHeader(
        run_id=MANIFEST.run_id, mb_id="m", stage=1, batch=batch, seq=SEQ, width=WIDTH, train=train
    )
    g = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, 256, (batch, SEQ + 1), generator=g)
    act = ActivationCodec(mode=mode).encode(torch.randn(batch, SEQ, WIDTH, generator=g))
    return encode_forward(header, tokens, act)


REQUESTS = [_request(1, "bf16"), _request(2, "int8"), _request(2, "fp32", train=False)]
_VALID_HEADER = {**ForwardHeader(run_id=MANIFEST.run_id, mb_id="m", stage=1, batch=2, seq=SEQ,
                                 width=WIDTH).__dict__}  # fmt: skip


@st.composite
def forward_requests(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["bytes", "fields", "activation", "tokens"]))
    if how == "bytes":
        return draw(mutated(REQUESTS))
    batch = 2
    header = json.dumps(_VALID_HEADER).encode()
    g = torch.Generator().manual_seed(0)
    tokens = encode_tokens(torch.randint(0, 256, (batch, SEQ + 1), generator=g))
    act = ActivationCodec(mode="fp32").encode(torch.randn(batch, SEQ, WIDTH, generator=g))
    if how == "fields":
        header = json.dumps(draw(field_edits(_VALID_HEADER))).encode()
    elif how == "tokens":
        tokens = draw(mutated([tokens]))
    else:  # a re-sealed frame: odd shapes, dtypes, codecs, huge or non-finite values
        act = draw(st.one_of(frame_edits([act]), mutated([act, *FRAMES], seal=seal_frame)))
    return b"".join(
        (len(header).to_bytes(4, "little"), header, len(tokens).to_bytes(4, "little"), tokens, act)
    )


async def _serve(pipeline: Pipeline, data: bytes) -> list[bytes]:
    return [chunk async for chunk in pipeline.handle("12D3KooWfuzzer", data)]


def _request_with(activation: torch.Tensor) -> bytes:
    header = ForwardHeader(**_VALID_HEADER)
    tokens = torch.zeros(2, SEQ + 1, dtype=torch.long)
    return encode_forward(header, tokens, ActivationCodec(mode="fp32").encode(activation))


HALF = ActivationCodec(mode="fp32").encode(torch.ones(2, SEQ, WIDTH, dtype=torch.float16))


@FUZZ
@given(forward_requests())
# a float16 frame decoded, then raised in the stage's float32 matmul:
@example(_request_with(torch.zeros(2, SEQ, WIDTH))[: -len(HALF)] + HALF)
# finite but huge: the input gradient overflowed, encoding it raised, the weights went NaN
@example(_request_with(torch.full((2, SEQ, WIDTH), 3e38)))
def test_the_forward_handler_answers_every_request(last_stage: StageWorker, data: bytes) -> None:
    pipeline = Pipeline(MANIFEST, last_stage, None, "me", lambda s: [], PipelineConfig())
    chunks = asyncio.run(_serve(pipeline, data))
    assert len(chunks) == 1
    reply, grad = decode_response(chunks[0])
    event(f"{reply.status} {reply.code}")
    assert reply.status in (Status.OK, Status.REJECTED, Status.BUSY)
    if reply.status == Status.OK and len(grad):
        batch = json.loads(data[4 : 4 + int.from_bytes(data[:4], "little")])["batch"]
        ActivationCodec().decode(grad, (batch, SEQ, WIDTH))
    assert pipeline.active_requests == 0
    assert all(bool(torch.isfinite(p).all()) for p in last_stage.masters)


# ---- a middle stage: the replies of the stage below (node/pipeline.py, _try_peer) ---------

MIDDLE = _small_manifest(stages=3)
_GRAD = torch.randn(2, SEQ, WIDTH, generator=torch.Generator().manual_seed(7))
DOWNSTREAM_REPLIES = [
    encode_response(ResponseHeader(status="ok", loss=2.0), ActivationCodec().encode(_GRAD)),
    encode_response(
        ResponseHeader(status="ok", loss=1.5), ActivationCodec(mode="int8").encode(_GRAD)
    ),
    error_response(Status.BUSY, Code_.OVERLOADED, "full"),
]
_OK_REPLY = {"status": "ok", "code": "", "message": "", "loss": 2.0, "stats": {}}


@st.composite
def downstream_replies(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["bytes", "fields", "gradient"]))
    if how == "bytes":
        return draw(mutated(DOWNSTREAM_REPLIES))
    header = json.dumps(_OK_REPLY).encode()
    grad = ActivationCodec(mode="fp32").encode(_GRAD)
    if how == "fields":
        header = json.dumps(draw(field_edits(_OK_REPLY))).encode()
    else:
        grad = draw(st.one_of(frame_edits([grad]), mutated([grad, *FRAMES], seal=seal_frame)))
    return b"".join((len(header).to_bytes(4, "little"), header, bytes(4), grad))


@pytest.fixture(scope="module")
def middle_stage():
    worker = StageWorker(MIDDLE, 1)
    try:
        yield worker
    finally:
        worker.close()


async def _no_sleep(_seconds: float) -> None:
    return None


@FUZZ
@given(downstream_replies())
def test_a_middle_stage_answers_whatever_the_stage_below_replies(
    middle_stage: StageWorker, reply: bytes
) -> None:
    """Stage 1 of 3 forwards a valid micro-batch; the replica of stage 2 answers with fuzzed
    bytes. The middle stage answers its caller and keeps no graph and finite weights."""
    header = ForwardHeader(run_id=MIDDLE.run_id, mb_id="m", stage=1, batch=2, seq=SEQ, width=WIDTH)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=g)
    request = encode_forward(
        header, tokens, ActivationCodec().encode(torch.randn(2, SEQ, WIDTH, generator=g))
    )
    config = PipelineConfig(deadline_s=0.01, hop_timeout_s=1.0)
    pipeline = Pipeline(MIDDLE, middle_stage, None, "me", lambda s: ["below"], config)

    async def below(*_args, **_kwargs) -> bytes:
        return reply

    with (
        mock.patch.object(streams, "request", below),
        mock.patch.object(pipeline_module.asyncio, "sleep", _no_sleep),
    ):
        chunks = asyncio.run(_serve(pipeline, request))
    answer, grad = decode_response(chunks[0])
    event(f"{answer.status} {answer.code}")
    assert len(chunks) == 1 and answer.status in set(Status)
    if answer.status == Status.OK:
        ActivationCodec().decode(grad, (2, SEQ, WIDTH))
    assert middle_stage.in_flight == 0
    assert all(bool(torch.isfinite(p).all()) for p in middle_stage.masters)


# ---- the collective's handlers (comms/collective/handlers.py, p2p.py) -------------------

MEMBERS = ("peer0", "peer1", "peer2")
NUMEL = 96


def _plan() -> GroupPlan:
    return GroupPlan(round=5, phase="delta", members=MEMBERS, numel=NUMEL, block=8)


PLAN = _plan()
PARTS = [
    encode_result(torch.randn(PLAN.span_numel(0)), WireFormat(result=codec, block=8))
    for codec in (Codec.FP32, Codec.BF16, Codec.INT8)
]
waits = st.one_of(st.sampled_from([0.0, -1.0, 0.01, float("nan"), -math.inf]), st.floats(0, 0.02))


@st.composite
def collective_headers(draw: st.DrawFn) -> Header:
    """Mostly about the registered collective (so checks past the lookup run), else anything."""
    known = draw(st.booleans())
    return Header(
        round=5 if known else draw(st.one_of(st.integers(0, 9), HUGE_INTS)),
        phase="delta" if known else draw(st.sampled_from(["delta", "anchor", "", "x" * 300])),
        group_id=PLAN.group_id if known else draw(st.binary(max_size=20)),
        span=draw(st.one_of(st.integers(-1, 3), HUGE_INTS)),
        attempt=draw(st.one_of(st.integers(-1, 3), HUGE_INTS)),
        weight=draw(st.one_of(st.floats(), ODD_FLOATS)),
        wait=draw(waits),  # inf is capped at MAX_WAIT (120 s): left out to keep CI fast
        signature=draw(st.binary(max_size=70)),
    )


senders = st.sampled_from([*MEMBERS, "stranger", ""])


@FUZZ
@given(
    st.sampled_from(["push", "admit", "fetch", "query", "check", "inventory"]),
    senders,
    collective_headers(),
    mutated(PARTS, seal=seal_frame),
    st.binary(max_size=20),
    st.booleans(),
)
def test_the_collective_responder_answers_every_request(
    kind: str, sender: str, header: Header, payload: bytes, nonce: bytes, signed: bool
) -> None:
    async def scenario() -> Reply | None:
        book = RoundBook("peer0")
        state = book.register(_plan())
        state.set_contribution(1.0, [PARTS[0]] * 3, [torch.zeros(PLAN.span_numel(0))] * 3)
        responder = Responder(book, verify=verify_signature if signed else None)
        if kind == "inventory":
            return await responder.on_inventory(sender, header, payload[:2])
        if kind == "push":
            return await responder.on_push(sender, header, payload)
        if kind == "admit":
            return await responder.admit_push(sender, header, len(payload))
        if kind == "fetch":
            return await responder.on_fetch(sender, header)
        if kind == "query":
            return await responder.on_query(sender, header)
        return await responder.on_check(sender, header, nonce, payload[:2])

    reply = asyncio.run(scenario())
    assert reply is None or isinstance(reply.code, Code)


uint32, uint64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)


@st.composite
def collective_messages(draw: st.DrawFn) -> CollectiveMessage:
    """A protobuf message with every field set by the peer."""
    known = draw(st.booleans())
    return CollectiveMessage(
        code=draw(uint32),
        round=5 if known else draw(uint64),
        phase="delta" if known else draw(st.text(max_size=10)),
        group_id=PLAN.group_id if known else draw(st.binary(max_size=20)),
        span=draw(st.one_of(st.integers(0, 3), uint32)),
        attempt=draw(st.one_of(st.integers(0, 3), uint32)),
        weight=draw(st.one_of(st.floats(), ODD_FLOATS)),
        wait=draw(waits),
        signature=draw(st.binary(max_size=80)),
        proofs=draw(st.binary(max_size=120)),
        data=draw(mutated(PARTS, seal=seal_frame)),
        total=draw(st.one_of(st.integers(0, 2 * max_frame_bytes(NUMEL)), uint64)),
        members=draw(st.binary(max_size=3)),
    )


@FUZZ
@given(
    st.sampled_from(["push", "fetch", "query", "check"]),
    senders,
    collective_messages(),
    st.lists(st.binary(max_size=300), max_size=3),
)
def test_the_collective_servicer_answers_every_message(
    kind: str, sender: str, first: CollectiveMessage, more: list[bytes]
) -> None:
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: sender))

    async def chunks():
        yield first
        for data in more:
            yield CollectiveMessage(data=data)

    async def scenario() -> list[CollectiveMessage]:
        book = RoundBook("peer0")
        book.register(_plan())
        servicer = CollectiveServicer(Responder(book), max_frame_bytes(NUMEL))
        if kind == "push":
            return [await servicer.rpc_push(chunks(), context)]
        if kind == "check":
            return [await servicer.rpc_check(first, context)]
        method = servicer.rpc_fetch if kind == "fetch" else servicer.rpc_query
        return [msg async for msg in method(first, context)]

    for msg in asyncio.run(scenario()):
        assert msg.code in set(Code)


# ---- the state server behind its stream framing (comms/state_transfer.py, streams.py) ---

BLOB = bytes(range(256)) * 3


class _Writer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def _frames_written(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        length = int.from_bytes(data[pos + 1 : pos + 9], "big")
        out.append((data[pos : pos + 1], data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    return out


STATE_REQUESTS = [
    streams.KIND_DATA + len(b) .to_bytes(8, "big") + b
    for b in (b'{"stage": 1}', b'{"stage": 0}', b"{}")
]  # fmt: skip


@FUZZ
@given(
    st.one_of(
        mutated(STATE_REQUESTS),
        field_edits({"stage": 1}, extra=["x"]).map(
            lambda r: (
                streams.KIND_DATA + len(json.dumps(r)).to_bytes(8, "big") + json.dumps(r).encode()
            )
        ),
    )
)
def test_the_state_server_answers_every_request(request: bytes) -> None:
    handlers = {}

    @contextlib.asynccontextmanager
    async def provider(stage: int):  # noqa: ANN202 - lends (header, blob), as service.state
        if stage != 1:
            raise state_transfer.StateTransferError(f"this node does not serve stage {stage}")
        yield {"round": 2}, BLOB

    async def scenario() -> bytes:
        p2p = SimpleNamespace()

        async def add_binary_stream_handler(name: str, handler) -> None:  # noqa: ANN001
            handlers[name] = handler

        p2p.add_binary_stream_handler = add_binary_stream_handler
        await state_transfer.serve_state(p2p, "run", provider, deadline_s=5.0)
        (on_stream,) = handlers.values()
        reader = asyncio.StreamReader()
        reader.feed_data(request)
        reader.feed_eof()
        writer = _Writer()
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "12D3KooWfuzzer"))
        await on_stream(info, reader, writer)
        return bytes(writer.data)

    frames = _frames_written(asyncio.run(scenario()))
    for kind, payload in frames:
        if kind == streams.KIND_ERROR:  # refused: with its declared error, nothing else
            assert payload.startswith(b"StateTransferError"), payload
    if frames and frames[0][0] == streams.KIND_DATA:
        header = state_transfer._parse_header(frames[0][1])
        assert header["bytes"] == len(BLOB) and frames[-1][0] == streams.KIND_END


# ---- membership: the SWIM state machine (comms/membership/swim.py) ----------------------


@FUZZ
@given(
    st.lists(st.tuples(st.sampled_from([ALICE.peer_id, "12D3KooWx", "b"]), mutated(ENVELOPES)),
    min_size=1, max_size=4),
    st.booleans(),
)  # fmt: skip
def test_membership_handles_every_message(messages: list[tuple[str, bytes]], real: bool) -> None:
    """With the null verifier, every mutation that still parses reaches the state machine."""
    sent: list[tuple[str, bytes]] = []
    me = SimpleNamespace(peer_id="bob", sign=lambda data: bytes(64))
    machine = Membership(
        me,
        Ed25519Verifier() if real else null_verify,
        send=lambda to, data: sent.append((to, data)),
        rng=random.Random(0),
        now=0.0,
        meta=MemberMeta(stage=0, state="active"),
    )
    now = 0.0
    for sender, data in messages:
        machine.on_message(sender, data, now)
        now += 0.7
        machine.tick(now)
    machine.tick(now + 60.0)
    assert machine.counters["received"] == len(messages)
    for view in machine.members():
        assert view.peer_id != "bob"


# ---- reads of round entries and records (comms/collective/groups.py, directory.py) ------


_ENTRY_BODY = {
    "peer_id": ALICE.peer_id,
    "run_id": "run",
    "stage": 1,
    "round": 4,
    "joined_at": time.time(),  # fresh for the whole run: the reader's ttl below is long
    "digest": "",
    "warming": False,
}


@FUZZ
@given(st.data())
def test_round_entry_reads_never_raise(data: st.DataObject) -> None:
    stored = {
        ALICE.peer_id: data.draw(signed_values(_ENTRY_BODY)),
        data.draw(st.text(max_size=60)): data.draw(signed_values(_ENTRY_BODY)),
    }
    board = MemoryBoard()
    board.data[outer_round_key("run", 1, 4)] = stored
    identity = SimpleNamespace(peer_id="12D3KooWme", sign=lambda data: bytes(64))
    matchmaker = Matchmaker(
        board, identity, run_id="run", stage=1, config=MatchmakingConfig(ttl=1e6)
    )

    async def scenario() -> None:
        entries = await matchmaker._read(outer_round_key("run", 1, 4), 4)
        assert all(e.peer_id == ALICE.peer_id and math.isfinite(e.joined_at) for e in entries)
        await matchmaker.opened_by_others(4, expect=[ALICE.peer_id, "12D3KooWme", "c"])

    asyncio.run(scenario())


_RECORD_BODY = json.loads(
    NodeRecord(run_id="run", peer_id=ALICE.peer_id, stage=1, state="active", ttl=60.0)
    .canonical_bytes()
)  # fmt: skip


@FUZZ
@given(st.data())
def test_directory_reads_never_raise(data: st.DataObject) -> None:
    raw = {
        ALICE.peer_id: data.draw(signed_values(_RECORD_BODY)),
        data.draw(st.one_of(st.text(max_size=60), st.integers())): data.draw(
            signed_values(_RECORD_BODY)
        ),
    }
    directory = Directory(None, ALICE, "run", 4)  # keep() reads no network
    kept = directory.keep(1, raw, now=_RECORD_BODY["issued_at"])
    assert all(r.stage == 1 and r.peer_id == ALICE.peer_id for r in kept)
    assert len(kept) + sum(directory.rejected.values()) == len(raw)


@FUZZ
@given(collective_messages(), st.lists(st.binary(max_size=300), max_size=3))
def test_collective_replies_are_read_within_their_bound(
    first: CollectiveMessage, more: list[bytes]
) -> None:
    """The client side of fetch and query (p2p._read_reply): a reply or ValueError (the
    driver counts the peer as failed), never more than `limit` bytes buffered."""
    limit = max_frame_bytes(NUMEL)

    async def stream():
        yield first
        for data in more:
            yield CollectiveMessage(data=data)

    try:
        reply = asyncio.run(_read_reply(stream(), limit))
    except ValueError:
        return
    assert isinstance(reply.code, Code) and len(reply.payload) == first.total <= limit
