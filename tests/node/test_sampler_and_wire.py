"""Pure parts of the data plane: sample ownership across heads, strict wire parsing."""

import asyncio
import struct
from pathlib import Path

import pytest
import torch

from agora_node.comms import linkemu
from agora_node.comms.pipeline_wire import (
    Code,
    ForwardHeader,
    WireError,
    decode_documents,
    decode_forward,
    decode_tokens,
    encode_documents,
    encode_forward,
    encode_tokens,
)
from agora_node.node.head import Sampler
from agora_node.stages.data import TokenWindows, document_ids
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.memory import default_in_flight, heads_in_flight

pytestmark = pytest.mark.timeout(60)


def test_a_head_keeps_one_steps_worth_in_flight_or_two_with_weight_prediction():
    tiny = load_manifest("tiny").inner
    assert (tiny.local_batch, tiny.micro_batch, tiny.weight_prediction) == (16, 8, False)
    assert heads_in_flight(tiny) == 2
    slow_links = Path(__file__).resolve().parents[2] / "bench/manifests/tiny-async.toml"
    slow = load_manifest(str(slow_links))
    assert heads_in_flight(slow.inner) == 4
    assert default_in_flight(slow, 0) == 4  # what --dry-run's memory plan counts, too


def test_two_heads_never_train_the_same_sample_in_an_epoch():
    windows = TokenWindows(load_manifest("tiny"), "train")
    heads = ["peer-a", "peer-b"]
    a, b = (Sampler(windows, h, lambda: heads) for h in heads)
    n = len(windows)
    claimed = {h: [] for h in heads}
    for sampler, name in ((a, "peer-a"), (b, "peer-b")):
        while sampler.position < n:  # one epoch each
            batch = sampler.claim(1)
            if sampler.position <= n:
                claimed[name].append(tuple(batch.ids[0].tolist()))
    assert not set(claimed["peer-a"]) & set(claimed["peer-b"])
    assert abs(len(claimed["peer-a"]) - len(claimed["peer-b"])) < 0.2 * n  # roughly balanced


def test_a_lone_head_walks_the_reference_order():
    windows = TokenWindows(load_manifest("tiny"), "train")
    sampler = Sampler(windows, "only", lambda: [])
    expected = windows.batch([int(i) for i in windows.epoch_order(0)[:8]])
    claimed = sampler.claim(8)
    assert torch.equal(claimed.ids, expected.ids)
    assert claimed.docs is None and expected.docs is None  # the built-in corpus: one document


def _header(**kw):
    base = dict(run_id="r", mb_id="m", stage=1, batch=2, seq=4, width=3)
    return ForwardHeader(**{**base, **kw})


def test_forward_round_trip_and_strictness():
    tokens = torch.randint(0, 256, (2, 5))
    data = encode_forward(_header(), tokens, b"payload")
    header, raw_tokens, raw_docs, payload = decode_forward(data)
    assert header.mb_id == "m" and bytes(payload) == b"payload"
    assert header.docs == 0 and raw_docs == b"" and decode_documents(raw_docs, 2, 4) is None
    assert torch.equal(decode_tokens(raw_tokens, 2, 4, 256), tokens)
    for bad, code in [
        (data[:5], Code.BAD_HEADER),
        (b"\xff\xff\xff\x00" + data[4:], Code.BAD_HEADER),
        (encode_forward(_header(batch=-1), tokens, b""), Code.BAD_HEADER),
        (encode_forward(_header(loss_scale=5.0), tokens, b""), Code.BAD_HEADER),
        # ids that re-encode larger when passed downstream (JSON escapes non-ASCII), or
        # are not strings, and flags that are not booleans
        (encode_forward(_header(mb_id="\u20ac" * 10), tokens, b""), Code.BAD_HEADER),
        (encode_forward(_header(mb_id="x" * 129), tokens, b""), Code.BAD_HEADER),
        (encode_forward(_header(origin=["o"]), tokens, b""), Code.BAD_HEADER),
        (encode_forward(_header(run_id="r\n"), tokens, b""), Code.BAD_HEADER),
        (encode_forward(_header(train=1), tokens, b""), Code.BAD_HEADER),
        (encode_forward(_header(version="1"), tokens, b""), Code.BAD_HEADER),
    ]:
        with pytest.raises(WireError) as info:
            decode_forward(bad)
        assert info.value.code == code
    with pytest.raises(WireError, match="outside the vocabulary"):
        decode_tokens(encode_tokens(torch.full((2, 5), 300)), 2, 4, 256)
    with pytest.raises(WireError, match="expected"):
        decode_tokens(encode_tokens(tokens), 2, 5, 256)


def test_token_ids_take_the_fewest_bytes():
    """One byte per id for byte-level vocabularies, two up to 65,535 (GPT-2's 50,257)."""
    for top, vocab, width in [
        (255, 256, 1),
        (256, 50_257, 2),
        (50_256, 50_257, 2),
        (70_000, 2**17, 4),
    ]:
        tokens = torch.tensor([[0, top, 7], [top, 1, 2]])
        data = encode_tokens(tokens)
        assert data[0] == width and len(data) == 1 + 6 * width
        assert torch.equal(decode_tokens(data, 2, 2, vocab), tokens)
    with pytest.raises(WireError, match="unknown token width"):
        decode_tokens(b"\x03" + bytes(18), 2, 2, 256)


def test_document_starts_travel_with_the_tokens_and_are_checked():
    """Packed rows: each row's document ids survive the wire exactly; a document section
    that does not describe rows of this batch is refused with its own code."""
    tokens = torch.randint(0, 256, (2, 7))
    docs = torch.stack([document_ids(6, torch.tensor([0, 2, 5])), document_ids(6, None)])
    data = encode_forward(_header(seq=6), tokens, b"payload", docs)
    header, raw_tokens, raw_docs, payload = decode_forward(data)
    assert bytes(payload) == b"payload" and header.docs == len(raw_docs) == 4 * (1 + 2 + 1)
    assert torch.equal(decode_documents(raw_docs, 2, 6), docs)
    assert decode_documents(encode_documents(torch.zeros(2, 6, dtype=torch.long)), 2, 6).sum() == 0

    def starts(*rows: list[int]) -> bytes:
        return b"".join(struct.pack(f"<I{len(r)}I", len(r), *r) for r in rows)

    for bad in [
        starts([2, 5]),  # one row short
        starts([2], [1], [3]),  # one row too many
        starts([0], []),  # a start at 0 is no boundary
        starts([6], []),  # past the row's last input
        starts([4, 2], []),  # not increasing
        starts([3, 3], []),  # twice
        struct.pack("<I", 10**6) + starts([]),  # a count beyond the row
        starts([2], [])[:-1],  # not whole uint32s
    ]:
        with pytest.raises(WireError) as info:
            decode_documents(bad, 2, 6)
        assert info.value.code == Code.BAD_DOCUMENTS
    overrun = bytearray(data)
    head_len = struct.unpack_from("<I", data)[0]
    overrun[4 : 4 + head_len] = data[4 : 4 + head_len].replace(b'"docs":16', b'"docs":99')
    with pytest.raises(WireError) as info:
        decode_forward(bytes(overrun))
    assert info.value.code == Code.BAD_DOCUMENTS


def test_link_emulation_serializes_and_delays():
    spec = linkemu.LinkSpec.parse("8,20")  # 8 Mbit/s = 1 MB/s, 20 ms one way
    emulator = linkemu.LinkEmulator(spec)

    async def two_sends() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.gather(emulator.transmit(100_000), emulator.transmit(100_000))
        return loop.time() - start

    elapsed = asyncio.run(two_sends())
    # 200 kB through a 1 MB/s uplink, back to back, plus one-way latency: >= 0.22 s.
    assert 0.22 <= elapsed < 1.0, elapsed
    with pytest.raises(ValueError):
        linkemu.LinkSpec.parse("fast")
    for spec in ("nan,5", "10,nan", "10,inf", "inf,0"):  # every send then hung
        with pytest.raises(ValueError, match="finite"):
            linkemu.LinkSpec.parse(spec)


def test_a_message_pays_the_link_latency_once(monkeypatch):
    """Its data frame waits the one-way latency; the empty END frame right behind it does
    not (until 2026-11-30 it did, holding the sender's task one latency longer)."""
    from agora_node.comms import streams

    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(linkemu.asyncio, "sleep", record)
    linkemu.configure(linkemu.LinkSpec.parse("1000,50"))  # 1 Gbit/s: transfer ~0

    class Writer:
        def write(self, data: bytes) -> None:
            pass

        async def drain(self) -> None:
            pass

    async def message() -> None:
        await streams.write_frame(Writer(), streams.KIND_DATA, b"x" * 1000)
        await streams.write_frame(Writer(), streams.KIND_END)

    try:
        asyncio.run(message())
    finally:
        linkemu.configure(None)
    assert len(waits) == 2
    assert 0.050 <= waits[0] < 0.051 and waits[1] < 0.001, waits
