"""Fuzzed input into every decoder of network bytes (issue 10): each answers with a value
that passes its own checks or with its declared error type, never another exception,
never an allocation beyond its declared bound. Handlers are fuzzed in test_handlers.py.

Examples per test: tests/fuzz/mutations.py (AGORA_FUZZ_EXAMPLES). Regressions found by
fuzzing are kept as @example.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import zlib

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import event, example, given
from hypothesis import strategies as st

from agora_node.comms import pipeline_wire, streams
from agora_node.comms.collective.entries import EntryError, RoundEntry
from agora_node.comms.collective.payload import (
    WireFormat,
    decode_span,
    encode_result,
    max_frame_bytes,
)
from agora_node.comms.collective.proofs import (
    PROOF_BYTES,
    Signing,
    attribute,
    pack_proofs,
    parse_proofs,
    sign_part,
)
from agora_node.comms.collective.verify import (
    SKETCH_ROWS,
    mask_members,
    parse_sketch,
    sketch_bytes,
)
from agora_node.comms.membership import messages as swim
from agora_node.comms.membership.messages import MalformedMessage, MemberMeta, MsgKind, Status
from agora_node.comms.pipeline_wire import ForwardHeader, ResponseHeader, WireError
from agora_node.comms.state_transfer import StateTransferError, _parse_header
from agora_node.compression import (
    ActivationCodec,
    Codec,
    CodecError,
    decode_dict,
    decode_tensor,
    encode_dict,
    encode_frame,
    quantize,
)
from agora_node.node import attestation
from agora_node.protocol import state_blob
from agora_node.protocol.identity import (
    Identity,
    IdentityError,
    public_key_from_peer_id,
    verify,
)
from agora_node.protocol.manifest import Manifest, ManifestError, manifest_from_canonical
from agora_node.protocol.records import (
    NodeRecord,
    NodeState,
    RecordError,
    RecordLimits,
    RunPointer,
    verify_record,
    verify_run_pointer,
)
from agora_node.stages.data import check_documents
from agora_node.stages.manifest_files import load_manifest
from tests.fuzz.mutations import (
    FUZZ,
    HUGE_INTS,
    TIMEOUT_S,
    deep_json,
    field_edits,
    json_values,
    mutated,
)

pytestmark = pytest.mark.timeout(TIMEOUT_S)

ALICE = Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
NOW = 1_700_000_000.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- tensor frames (compression/framing.py) --------------------------------------------

_FIXED = 29  # bytes before the shape (framing.py's layout)
_FRAME_FIELDS = [  # (offset, struct format) of every fixed header field after the magic
    (4, "<B"), (5, "<B"), (6, "<B"), (7, "<B"), (8, "<B"),
    (9, "<I"), (13, "<Q"), (21, "<Q"), (29, "<Q"), (37, "<Q"),
]  # fmt: skip


def _frames(shape: tuple[int, ...]) -> list[bytes]:
    x = torch.randn(shape, generator=_gen(0))
    sparse = torch.zeros(shape)
    sparse.view(-1)[::7] = 1.0
    return [
        encode_frame(quantize(x, Codec.FP32)),
        encode_frame(quantize(x.bfloat16(), Codec.BF16)),
        encode_frame(quantize(x, Codec.INT8, block=8)),
        encode_frame(quantize(x, Codec.INT8, block=16, seed=3)),
        encode_frame(quantize(x, Codec.INT4, block=8, scale_dtype=torch.bfloat16)),
        encode_frame(quantize(sparse, Codec.INT8, block=64)),  # zstd-compressed payload
    ]


def seal_frame(frame: bytes) -> bytes:
    """Recompute a tensor frame's crc, so that an edited header reaches the parser."""
    if len(frame) < _FIXED:
        return frame
    n = _FIXED + 8 * frame[8]
    if len(frame) < n + 4:
        return frame
    payload = frame[n + 4 :]
    return frame[:n] + struct.pack("<I", zlib.crc32(payload, zlib.crc32(frame[:n]))) + payload


@st.composite
def frame_edits(draw: st.DrawFn, valid: list[bytes]) -> bytes:
    """A valid frame with one or two header fields set to arbitrary values, re-sealed."""
    data = bytearray(draw(st.sampled_from(valid)))
    for _ in range(draw(st.integers(1, 2))):
        offset, fmt = draw(st.sampled_from(_FRAME_FIELDS))
        if offset + struct.calcsize(fmt) > len(data):
            continue
        top = (1 << (8 * struct.calcsize(fmt))) - 1
        value = draw(st.one_of(st.integers(0, top), st.sampled_from([0, 1, 2, 3, 9, top])))
        struct.pack_into(fmt, data, offset, value)
    return seal_frame(bytes(data))


SHAPE = (2, 3, 8)
FRAMES = _frames(SHAPE)
frames = st.one_of(mutated(FRAMES, seal=seal_frame), frame_edits(FRAMES))


def _bounded(t: torch.Tensor, max_bytes: int) -> None:
    # the decoded float tensor is at most ~8x the frame bound (int4 -> float32)
    assert t.numel() * 4 <= 8 * max_bytes + 64


@FUZZ
@given(frames, st.booleans())
@example(seal_frame(FRAMES[0][:_FIXED] + struct.pack("<3Q", 2**40, 2**40, 2**40) + b"\0" * 4), True)
def test_tensor_frames(data: bytes, expect_shape: bool) -> None:
    limit = 4 * math.prod(SHAPE) + 128
    try:
        t = decode_tensor(data, max_bytes=limit, expected_shape=SHAPE if expect_shape else None)
    except CodecError:
        event("refused")
        return
    assert bool(torch.isfinite(t).all())
    assert not expect_shape or tuple(t.shape) == SHAPE
    _bounded(t, limit)


def seal_dict(data: bytes) -> bytes:
    if len(data) < 4:
        return data
    body = data[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


DICTS = [
    encode_dict({"w": quantize(torch.randn(4, 4, generator=_gen(1)), Codec.INT8, block=8)}),
    encode_dict({"a": quantize(torch.randn(3), Codec.FP32), "b": quantize(torch.zeros(5))}),
]


@FUZZ
@given(mutated(DICTS, seal=seal_dict), st.booleans())
def test_dict_frames(data: bytes, expect: bool) -> None:
    shapes = {"a": (3,), "b": (5,)} if expect else None
    try:
        out = decode_dict(data, max_bytes=4096, expected_shapes=shapes)
    except CodecError:
        event("refused")
        return
    assert shapes is None or {k: tuple(v.shape) for k, v in out.items()} == shapes
    for t in out.values():
        assert bool(torch.isfinite(t).all())
        _bounded(t, 4096)


@FUZZ
@given(frames, st.sampled_from(["fp32", "bf16", "int8", "int4"]))
def test_activation_codec(data: bytes, mode: str) -> None:
    """Boundary activations and gradients: any mode is read, the shape is the receiver's."""
    try:
        y = ActivationCodec(mode=mode).decode(data, SHAPE)
    except CodecError:
        event("refused")
        return
    assert tuple(y.shape) == SHAPE and bool(torch.isfinite(y).all())


SPAN = 40
SPANS = [
    encode_result(torch.randn(SPAN, generator=_gen(2)), WireFormat(result=codec, block=8))
    for codec in (Codec.FP32, Codec.BF16, Codec.INT8, Codec.INT4)
]


@FUZZ
@given(st.one_of(mutated(SPANS, seal=seal_frame), frame_edits(SPANS)))
def test_collective_span_frames(data: bytes) -> None:
    """A member's part or a reducer's result (comms/collective/payload.py)."""
    try:
        value = decode_span(data, SPAN)
    except CodecError:
        event("refused")
        return
    assert value.shape == (SPAN,) and value.dtype == torch.float32
    assert bool(torch.isfinite(value).all()) and len(data) <= max_frame_bytes(SPAN)


SKETCH = sketch_bytes(torch.randn(SPAN, generator=_gen(3)), b"n" * 16)


@FUZZ
@given(mutated([SKETCH], max_random=8 * (SKETCH_ROWS + 2)), st.binary(max_size=4))
def test_sketches_and_member_masks(data: bytes, mask: bytes) -> None:
    got = parse_sketch(data)
    assert got is None or (bool(torch.isfinite(got).all()) and got[0] >= 0)
    members = ("a", "b", "c", "d", "e")
    named = mask_members(members, mask)
    assert named is None or set(named) <= set(members)


_KEYS = [Identity.generate() for _ in range(3)]
_GROUP = b"g" * 16
_PROOFS = pack_proofs(
    [sign_part(Signing(k.sign, verify), _GROUP, 1, 1.0, bytes([i])) for i, k in enumerate(_KEYS)]
)


@FUZZ
@given(mutated([_PROOFS], max_random=4 * PROOF_BYTES))
def test_signed_entries_of_a_result(data: bytes) -> None:
    """Entries from the wire (proofs.py): the wrong count is None; a mutated entry is at
    worst a forgery `attribute` blames on whoever presented it, never an exception."""
    named = [k.peer_id for k in _KEYS]
    parsed = parse_proofs(data, len(named))
    assert parsed is None or len(parsed) == len(named)
    verdict = attribute(verify, _GROUP, 1, named, data, _PROOFS)
    if data == _PROOFS:
        event("same entries")
        assert verdict.reducer_unknown
    else:
        assert verdict.owner_forged and not verdict.witness_forged and not verdict.equivocators


# ---- pipeline wire (comms/pipeline_wire.py) ---------------------------------------------

_HEADER = ForwardHeader(run_id="run", mb_id="m1", stage=1, batch=2, seq=3, width=8)
_TOKENS = torch.arange(8).reshape(2, 4)
_ACT = ActivationCodec(mode="int8").encode(torch.randn(2, 3, 8, generator=_gen(4)))


def pack(header: bytes, tokens: bytes, payload: bytes) -> bytes:
    """pipeline_wire's layout, with the header bytes given as they are."""
    return b"".join(
        (struct.pack("<I", len(header)), header, struct.pack("<I", len(tokens)), tokens, payload)
    )


FORWARDS = [
    pipeline_wire.encode_forward(_HEADER, _TOKENS, _ACT),
    pipeline_wire.encode_forward(_HEADER, _TOKENS * 4000, b""),  # int32 token ids
    pipeline_wire.encode_forward(_HEADER, _TOKENS, _ACT, torch.tensor([[0, 0, 1], [0, 1, 2]])),
]
RESPONSES = [
    pipeline_wire.encode_response(ResponseHeader(status="ok", loss=2.5), _ACT),
    pipeline_wire.error_response(pipeline_wire.Status.REJECTED, pipeline_wire.Code.BAD_SHAPE, "no"),
]


@st.composite
def wire_messages(draw: st.DrawFn, valid: list[bytes], header: dict) -> bytes:
    how = draw(st.sampled_from(["bytes", "fields", "deep"]))
    if how == "bytes":
        return draw(mutated(valid))
    tokens = pipeline_wire.encode_tokens(_TOKENS)
    if how == "deep":  # a header nested too deep for json.loads
        return pack(deep_json(draw(st.integers(500, 2000))), tokens, _ACT)
    body = draw(field_edits(header, extra=["unknown"]))
    return pack(json.dumps(body).encode(), tokens, _ACT)


@FUZZ
@given(wire_messages(FORWARDS, _HEADER.__dict__))
@example(pack(deep_json(2000), b"", b""))  # RecursionError escaped as a non-WireError
def test_forward_requests(data: bytes) -> None:
    try:
        header, tokens, docs, payload = pipeline_wire.decode_forward(data)
    except WireError:
        event("refused")
        return
    for name in ("stage", "batch", "seq", "width", "docs"):
        value = getattr(header, name)
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 0
    assert 0 < header.loss_scale <= 1
    assert isinstance(tokens, bytes) and isinstance(payload, memoryview)
    assert isinstance(docs, bytes) and len(docs) == header.docs


@FUZZ
@given(st.binary(max_size=64) | mutated([b"\x01\0\0\0\x02\0\0\0\0\0\0\0"]))
def test_document_sections(data: bytes) -> None:
    """Any bytes as the document starts of 2 rows of 5: refused with its code, or ids
    that start at 0 and grow by 0 or 1 per position."""
    try:
        docs = pipeline_wire.decode_documents(data, 2, 5)
    except WireError as exc:
        assert exc.code == pipeline_wire.Code.BAD_DOCUMENTS
        event("refused")
        return
    if docs is not None:
        check_documents(docs, 2, 5)


@FUZZ
@given(wire_messages(RESPONSES, {"status": "ok", "code": "", "message": "", "loss": 1.0}))
@example(pack(b'{"status":"ok","loss":"x"}', b"", b""))  # float(loss) raised at the sender
@example(pack(b'{"status":"ok","loss":' + b"9" * 400 + b"}", b"", b""))
def test_responses(data: bytes) -> None:
    try:
        header, payload = pipeline_wire.decode_response(data)
    except WireError:
        event("refused")
        return
    assert header.status in set(pipeline_wire.Status)
    assert header.loss is None or isinstance(header.loss, float)
    assert isinstance(header.code, str) and isinstance(header.message, str)
    assert isinstance(payload, memoryview)


@FUZZ
@given(
    mutated([pipeline_wire.encode_tokens(_TOKENS), pipeline_wire.encode_tokens(_TOKENS * 4000)]),
    st.one_of(st.just(2), st.integers(0, 4), HUGE_INTS),  # 2 x (3 + 1): the valid ones
    st.one_of(st.just(3), st.integers(0, 5), HUGE_INTS),
    st.one_of(st.integers(1, 2**16), HUGE_INTS),
)
@example(b"\x02", 0, 2**70, 10)  # batch 0 let any seq reach numpy's reshape
def test_token_sections(data: bytes, batch: int, seq: int, vocab: int) -> None:
    try:
        ids = pipeline_wire.decode_tokens(data, batch, seq, vocab)
    except WireError:
        event("refused")
        return
    assert tuple(ids.shape) == (batch, seq + 1) and ids.numel() <= len(data)
    assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab)


# ---- stream framing (comms/streams.py) -------------------------------------------------

STREAM_FRAMES = [
    streams.KIND_DATA + (5).to_bytes(8, "big") + b"hello",
    streams.KIND_END + bytes(8),
    streams.KIND_ERROR + (3).to_bytes(8, "big") + b"bad",
]


async def _read_frame(data: bytes, max_bytes: int, eof: bool = True) -> tuple[bytes, bytes]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return await streams.read_frame(reader, max_bytes)


@FUZZ
@given(mutated(STREAM_FRAMES, max_random=64), st.integers(0, 16))
def test_stream_frames(data: bytes, max_bytes: int) -> None:
    try:
        kind, payload = asyncio.run(_read_frame(data, max_bytes))
    except streams.StreamError:
        event("refused")
        return
    assert kind in (streams.KIND_DATA, streams.KIND_END, streams.KIND_ERROR)
    assert len(payload) <= max_bytes


@FUZZ
@given(st.integers(17, 2**64 - 1), st.sampled_from([b"D", b"E", b"X"]))
def test_stream_frame_sizes_are_refused_before_reading(length: int, kind: bytes) -> None:
    """An announced length over the limit is refused at once: the reader does not wait
    for (or buffer) the body it announced."""

    async def scenario() -> None:
        head = kind + length.to_bytes(8, "big")
        with pytest.raises(streams.StreamError, match="exceeds"):
            await asyncio.wait_for(_read_frame(head, 16, eof=False), 5.0)

    asyncio.run(scenario())


# ---- state transfer (protocol/state_blob.py, comms/state_transfer.py) --------------------

N = 23
BLOBS = [
    state_blob.encode(5, torch.randn(N, generator=_gen(5)), torch.randn(N, generator=_gen(6))),
    state_blob.encode(0, torch.zeros(N), None),
]


@st.composite
def blob_headers(draw: st.DrawFn) -> bytes:
    """Valid values after a header with arbitrary round, count and flags."""
    fields = draw(
        st.tuples(
            st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([-1, 0, 2**53 + 1])),
            st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([N, N + 1, 2**62])),
            st.integers(0, 255),
        )
    )
    tail = draw(st.sampled_from(BLOBS))[state_blob.HEADER_BYTES :]
    return struct.pack("<8sqQB", state_blob.MAGIC, *fields) + tail


@FUZZ
@given(st.one_of(mutated(BLOBS), blob_headers()))
def test_state_blobs(blob: bytes) -> None:
    try:
        got = state_blob.decode(blob, N)
    except state_blob.StateFormatError:
        event("refused")
        return
    assert got.anchor.shape == (N,) and bool(torch.isfinite(got.anchor).all())
    assert got.momentum is None or bool(torch.isfinite(got.momentum).all())
    assert 0 <= got.round <= state_blob.MAX_ROUND and len(blob) <= state_blob.max_bytes(N)


_STATE_HEADER = {"bytes": 100, "sha256": "0" * 64, "round": 3, "anchor_digest": "ab"}


@FUZZ
@given(
    st.one_of(
        mutated([json.dumps(_STATE_HEADER).encode()]),
        field_edits(_STATE_HEADER).map(lambda h: json.dumps(h).encode()),
        st.integers(500, 5000).map(deep_json),
    )
)
@example(b'{"bytes": 1e999, "sha256": "' + b"0" * 64 + b'"}')  # OverflowError
@example(deep_json(5000))  # RecursionError
def test_state_transfer_headers(frame: bytes) -> None:
    try:
        header = _parse_header(frame, max_bytes=1000)
    except StateTransferError:
        event("refused")
        return
    assert 0 <= int(header["bytes"]) <= 1000 and len(str(header["sha256"])) == 64


# ---- records, run pointers, attestations (protocol/records.py, node/attestation.py) ------

_RECORD = NodeRecord(
    run_id="run", peer_id=ALICE.peer_id, stage=1, state="active", issued_at=NOW, ttl=60.0,
    anchor_round=2, anchor_digest="a" * 32, outer_digest="b" * 32,
)  # fmt: skip
_RECORD_BODY = json.loads(_RECORD.canonical_bytes())


@st.composite
def signed_values(draw: st.DrawFn, body: dict, signer: Identity = ALICE) -> object:
    """What a DHT read returns under a subkey: junk, or a body (edited, nested too deep,
    mutated bytes) signed by the key that the subkey names, so that it passes the signature."""
    how = draw(st.sampled_from(["junk", "fields", "fields", "bytes", "deep"]))
    if how == "junk":
        return draw(
            st.one_of(
                json_values,
                st.fixed_dictionaries({"r": st.binary(max_size=64), "s": st.binary(max_size=64)}),
                st.fixed_dictionaries({"r": json_values, "s": st.binary(max_size=64)}),
            )
        )
    valid = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if how == "fields":
        data = json.dumps(draw(field_edits(body, extra=["extra_field"]))).encode()
    elif how == "deep":
        data = deep_json(draw(st.integers(400, 2000)))
    else:
        data = draw(mutated([valid]))
    return {"r": data, "s": signer.sign(data)}


@FUZZ
@given(signed_values(_RECORD_BODY))
@example({"r": deep_json(2000), "s": ALICE.sign(deep_json(2000))})
def test_node_records(value: object) -> None:
    limits = RecordLimits(num_stages=4)
    try:
        record = verify_record(value, run_id="run", peer_id=ALICE.peer_id, limits=limits, now=NOW)
    except RecordError as exc:
        event("refused")
        assert exc.reason  # a label for the status page and metrics
        return
    limits.check(record)
    assert record.peer_id == ALICE.peer_id and record.run_id == "run"
    attestation.attestation_of(record)  # reads the optional fields without raising


_POINTER = RunPointer(run_id="run", name="tiny", publisher=ALICE.peer_id, issued_at=NOW)
_POINTER_BODY = json.loads(_POINTER.canonical_bytes())


@FUZZ
@given(signed_values(_POINTER_BODY))
def test_run_pointers(value: object) -> None:
    try:
        pointer = verify_run_pointer(value, subkey="run", now=NOW)
    except RecordError:
        event("refused")
        return
    assert pointer.run_id == "run" and pointer.name.isprintable()
    assert 0 < pointer.ttl <= 600 and math.isfinite(pointer.issued_at)


digests = st.one_of(
    st.sampled_from(["a" * 32, "b" * 32, "A" * 32, "", "a" * 31]), st.text(max_size=33)
)
attesting_records = st.builds(
    NodeRecord,
    run_id=st.just("run"),
    peer_id=st.sampled_from(["p1", "p2", "p3", "p4", "p5", "me"]),
    stage=st.integers(0, 1),
    state=st.sampled_from(list(NodeState)).map(str),
    queue=st.integers(0, 10),
    throughput=st.floats(0, 1e9),
    anchor_round=st.one_of(st.integers(-3, 3), HUGE_INTS),
    anchor_digest=digests,
    outer_digest=digests,
)


@FUZZ
@given(st.lists(attesting_records, max_size=8), st.integers(-1, 4), digests)
def test_attestations(records: list[NodeRecord], round_no: int, digest: str) -> None:
    """A joiner's decision from records' attestation fields (node/attestation.py)."""
    replicas = attestation.live_replicas(records, 1, "me")
    plan = attestation.plan_sources(replicas, exclude={"p1"})
    assert len({r.peer_id for r in replicas}) == len(replicas) == plan.replicas
    if plan.majority is not None:
        assert 2 * plan.votes > plan.replicas and "p1" not in plan.sources
        assert len(plan.majority.anchor) == state_blob.DIGEST_CHARS
    else:
        assert plan.sources == ()
    assert attestation.check(plan, round_no, digest) in {
        attestation.Verdict.ADOPT,
        attestation.Verdict.STALE,
        attestation.Verdict.REJECT,
    }
    attestation.prefer_replicas(plan, round_no if round_no >= 0 else None)


# ---- round entries (comms/collective/groups.py) -----------------------------------------

_ENTRY = RoundEntry(peer_id=ALICE.peer_id, run_id="run", stage=1, round=4, joined_at=NOW)
_ENTRY_BODY = json.loads(_ENTRY.canonical_bytes())


_NULL_DIGEST = json.dumps({**_ENTRY_BODY, "digest": None}).encode()


_HUGE_JOINED = json.dumps({**_ENTRY_BODY, "joined_at": 10**400}).encode()


@FUZZ
@given(signed_values(_ENTRY_BODY))
@example({"r": _NULL_DIGEST, "s": ALICE.sign(_NULL_DIGEST)})  # was kept with digest None
@example({"r": _HUGE_JOINED, "s": ALICE.sign(_HUGE_JOINED)})  # OverflowError, not EntryError
def test_round_entries(value: object) -> None:
    try:
        entry = RoundEntry.verified(value, peer_id=ALICE.peer_id, run_id="run", stage=1, round_no=4)
    except EntryError:
        event("refused")
        return
    assert (entry.peer_id, entry.run_id, entry.stage, entry.round) == (ALICE.peer_id, "run", 1, 4)
    assert math.isfinite(entry.joined_at)
    assert isinstance(entry.digest, str) and isinstance(entry.warming, bool)


# ---- the manifest from the DHT (protocol/manifest.py) -----------------------------------

_MANIFEST = load_manifest("tiny")
_MANIFEST_BODY = json.loads(_MANIFEST.canonical_bytes())


@st.composite
def manifests(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["bytes", "tables", "fields", "deep"]))
    if how == "bytes":
        return draw(mutated([_MANIFEST.canonical_bytes()]))
    if how == "deep":
        return deep_json(draw(st.integers(400, 3000)))
    body = json.loads(_MANIFEST.canonical_bytes())
    if how == "tables":
        body = draw(field_edits(body, extra=["unknown"]))
    else:
        table = draw(st.sampled_from(sorted(k for k in body if isinstance(body[k], dict))))
        body[table] = draw(field_edits(body[table], extra=["unknown"]))
    return json.dumps(body).encode()


@FUZZ
@given(manifests())
@example(deep_json(3000))  # RecursionError escaped fetch_manifest's ManifestError handling
def test_manifests_from_the_swarm(data: bytes) -> None:
    try:
        manifest = manifest_from_canonical(data)
    except ManifestError:
        event("refused")
        return
    assert isinstance(manifest, Manifest)
    assert len(manifest.run_id) == 16  # canonical form and hash compute


# ---- membership messages (comms/membership/messages.py) ---------------------------------


def _swim_item(kind: Status, inc: int = 1) -> bytes:
    accuser = ALICE.peer_id if kind in (Status.SUSPECT, Status.DEAD) else None
    meta = MemberMeta(stage=1, state="active") if kind == Status.ALIVE else None
    body = swim.item_body(kind, ALICE.peer_id, inc, meta=meta, accuser=accuser)
    return body + ALICE.sign(swim.ITEM_DOMAIN + body)


SWIM_ITEMS = [_swim_item(s) for s in Status]


def _envelope(kind: MsgKind, body: bytes, items: list[bytes]) -> bytes:
    unsigned = swim.encode_envelope(kind, 7, body, items)
    return unsigned + ALICE.sign(swim.envelope_signing_input(ALICE.peer_id, "bob", unsigned))


ENVELOPES = [
    _envelope(MsgKind.PING, swim.probe_body(3), SWIM_ITEMS[:2]),
    _envelope(MsgKind.ACK, swim.probe_body(3), []),
    _envelope(MsgKind.PING_REQ, swim.ping_req_body(3, "12D3KooWtarget", 150), SWIM_ITEMS[3:]),
    _envelope(
        MsgKind.PUSH_PULL,
        swim.push_pull_body(
            False,
            [
                swim.entry_bytes(Status.ALIVE, 1, SWIM_ITEMS[0]),
                swim.entry_bytes(Status.SUSPECT, 1, SWIM_ITEMS[0], SWIM_ITEMS[1]),
            ],
        ),
        [],
    ),
    swim.encode_envelope(MsgKind.GOSSIP, 1, b"", SWIM_ITEMS, signed=False),
]


@FUZZ
@given(mutated(ENVELOPES))
def test_membership_envelopes(data: bytes) -> None:
    try:
        env = swim.decode_envelope(data)
    except MalformedMessage:
        return
    assert env.kind in set(MsgKind) and len(env.items) <= 255
    assert len(env.unsigned_part) + len(env.signature) == len(data)
    for entry in env.entries:
        assert entry.record.kind in (Status.ALIVE, Status.LEFT)


@FUZZ
@given(mutated(SWIM_ITEMS, max_random=200))
def test_membership_items(raw: bytes) -> None:
    try:
        item = swim.decode_item(raw)
    except MalformedMessage:
        return
    assert item.raw == raw and item.kind in set(Status)
    assert (item.meta is not None) == (item.kind == Status.ALIVE)


# ---- peer ids (protocol/identity.py) ----------------------------------------------------


@FUZZ
@given(
    st.one_of(
        st.just(ALICE.peer_id),
        st.text(max_size=80),
        st.text(alphabet="123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"),
        mutated([ALICE.peer_id.encode()]).map(lambda b: b.decode("latin-1")),
    ),
    st.binary(max_size=70),
)
def test_peer_ids(peer_id: str, signature: bytes) -> None:
    """A peer id read from a record, an entry's subkey or a membership message."""
    try:
        key = public_key_from_peer_id(peer_id)
    except IdentityError:
        event("refused")
        key = None
    assert key is None or len(key) == 32
    assert verify(peer_id, b"message", signature) in (True, False)


def test_a_signed_entry_nested_too_deep_is_refused() -> None:
    """A stranger's signed entry of 1000 "[" raised RecursionError out of Matchmaker._read,
    ending every replica's round gathering. Outside @given: hypothesis raises the
    recursion limit, and 1 KiB (the entry bound) nests no deeper than this."""
    data = b"[" * 1000
    with pytest.raises(EntryError):
        RoundEntry.verified(
            {"r": data, "s": ALICE.sign(data)},
            peer_id=ALICE.peer_id,
            run_id="run",
            stage=1,
            round_no=4,
        )
