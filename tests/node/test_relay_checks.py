"""What a hostile relay can do to a request or an answer (comms/relay.py, relay_wire.py), on bytes fed
to a stream reader: the target takes only a request its caller signed, for itself, once,
within the time window; the caller takes only an answer the target signed."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from agora_node.comms import relay_wire, streams
from agora_node.comms.guard import Guard
from agora_node.comms.relay import Relaying
from agora_node.comms.relay_wire import AnswerSigner, Header, RelayError
from agora_node.protocol.identity import Identity

pytestmark = pytest.mark.timeout(30)
RUN = "checks"
ECHO = f"/agora/{RUN}/echo/1"
NOW = 1_800_000_000.0


class _Daemon:
    """Stands in for a P2P object: streams.serve registers the handler on it."""

    async def add_binary_stream_handler(self, name, handler) -> None:  # noqa: ANN001
        pass


def _frame(kind: bytes, payload: bytes) -> bytes:
    return kind + len(payload).to_bytes(streams.LEN_BYTES, "big") + payload


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def _request(
    caller: Identity, to: str, body: bytes, *, t: float = NOW, origin: str | None = None
) -> bytes:
    """A request as a relay passes it on: the caller's signed header plus `from`."""
    nonce = os.urandom(16).hex()
    digest = hashlib.sha256(body).digest()
    t_ms = int(t * 1000)
    sig = caller.sign(relay_wire.request_message(to, ECHO, t_ms, nonce, digest)).hex()
    header = Header(to, ECHO, t_ms, nonce, sig, origin or caller.peer_id).encode()
    return _frame(streams.KIND_DATA, len(header).to_bytes(4, "big") + header + body)


@pytest.fixture
async def target():  # noqa: ANN201
    daemon, identity = _Daemon(), Identity.generate()

    async def echo(remote: str, request: bytes):  # noqa: ANN202
        yield request

    await streams.serve(daemon, ECHO, echo, max_request=1024)
    return daemon, Relaying(identity, RUN, clock=lambda: NOW)


async def _take(target, data: bytes):  # noqa: ANN001, ANN202
    daemon, relaying = target
    return await relaying.take(daemon, Guard("relayed"), "relay-peer", _reader(data))


async def test_an_honest_request_is_taken_as_its_callers(target) -> None:  # noqa: ANN001
    caller = Identity.generate()
    served, header, body = await _take(target, _request(caller, target[1].me, b"hello"))
    assert (served.name, header.origin, body) == (ECHO, caller.peer_id, b"hello")


@pytest.mark.parametrize(
    ("forge", "code"),
    [
        ("body", "signature"),  # the relay altered the body
        ("origin", "signature"),  # the relay names another caller
        ("stale", "time"),
        ("future", "time"),
        ("target", "target"),  # meant for another peer
        ("protocol", "protocol"),
        ("header", "header"),
        ("nested", "header"),  # a JSON nesting bomb within the header's size
        ("nobody", "target"),  # no `from`: not a relayed request
    ],
)
async def test_a_forged_request_is_refused_with_its_code(target, forge: str, code: str) -> None:  # noqa: ANN001
    caller, me = Identity.generate(), target[1].me
    data = {
        "body": lambda: _request(caller, me, b"hello").replace(b"hello", b"HELLO"),
        "origin": lambda: _request(caller, me, b"hello", origin=Identity.generate().peer_id),
        "stale": lambda: _request(caller, me, b"hello", t=NOW - relay_wire.WINDOW_S - 1),
        "future": lambda: _request(caller, me, b"hello", t=NOW + relay_wire.WINDOW_S + 1),
        "target": lambda: _request(caller, Identity.generate().peer_id, b"hello"),
        "protocol": lambda: _request(caller, me, b"x").replace(b"/echo/1", b"/ohce/1"),
        "header": lambda: _frame(streams.KIND_DATA, (5000).to_bytes(4, "big") + b"{" * 5000),
        "nested": lambda: _frame(streams.KIND_DATA, (2000).to_bytes(4, "big") + b"[" * 2000),
        "nobody": lambda: _unsigned_origin(caller, me),
    }[forge]()
    with pytest.raises(RelayError) as err:
        await _take(target, data)
    assert err.value.code == code


def _unsigned_origin(caller: Identity, me: str) -> bytes:
    """A header without `from`: what the caller sends its relay, passed on unchanged."""
    nonce, t_ms = os.urandom(16).hex(), int(NOW * 1000)
    sig = caller.sign(
        relay_wire.request_message(me, ECHO, t_ms, nonce, hashlib.sha256(b"").digest())
    )
    header = Header(me, ECHO, t_ms, nonce, sig.hex()).encode()
    return _frame(streams.KIND_DATA, len(header).to_bytes(4, "big") + header)


async def test_a_request_passed_on_twice_is_refused_the_second_time(target) -> None:  # noqa: ANN001
    data = _request(Identity.generate(), target[1].me, b"hello")
    await _take(target, data)
    with pytest.raises(RelayError) as err:
        await _take(target, data)
    assert err.value.code == "replay"


async def test_a_request_larger_than_its_protocol_takes_is_refused_before_its_body(target) -> None:  # noqa: ANN001
    data = _request(Identity.generate(), target[1].me, b"x" * 2000)  # echo takes 1024
    with pytest.raises(ConnectionError, match="oversized"):  # cut after the header
        head = 1 + streams.LEN_BYTES + 4
        await _take(target, data[: head + int.from_bytes(data[head - 4 : head], "big")])


async def test_an_origin_its_protocol_refuses_is_refused_before_its_body() -> None:
    """The body (up to the protocol's cap: a stage's weights for cell work) was read before
    the protocol's own refusal of the origin, which a direct stream asks first."""
    from agora_node.comms import relay as relay_module

    daemon, identity = _Daemon(), Identity.generate()
    caller, stranger = Identity.generate(), Identity.generate()

    async def echo(remote: str, request: bytes):  # noqa: ANN202
        yield request

    def refuse(origin: str) -> str | None:
        return None if origin == caller.peer_id else "not this cell's leader"

    await streams.serve(daemon, ECHO, echo, max_request=1024, refuse=refuse)
    relaying = Relaying(identity, RUN, clock=lambda: NOW)
    data = _request(stranger, identity.peer_id, b"x" * 1000)
    head = 1 + streams.LEN_BYTES + 4
    header_only = data[: head + int.from_bytes(data[head - 4 : head], "big")]
    with pytest.raises(relay_module._OriginRefused, match="leader"):  # not "closed mid-request"
        await relaying.take(daemon, Guard("relayed"), "relay-peer", _reader(header_only))

    async def busy() -> str:
        with pytest.raises(RelayError) as err:
            body = _request(caller, identity.peer_id, b"y" * 100)
            await relaying.take(daemon, Guard("relayed"), "relay-peer", _reader(body))
        return err.value.code

    relaying._reading_from["relay-peer"] = relay_module.MAX_READING_PER_RELAY - 10
    assert await busy() == "busy"  # this relay's share is taken
    relaying._reading_from.clear()
    relaying._reading_from["others"] = relay_module.MAX_READING_BYTES - 10  # being read
    assert await busy() == "busy"
    relaying._reading_from.clear()
    served, header, body = await relaying.take(
        daemon, Guard("relayed"), "relay-peer", _reader(_request(caller, identity.peer_id, b"ok"))
    )
    assert (header.origin, body) == (caller.peer_id, b"ok")
    assert not relaying._reading_from  # nothing held once read


def test_nonces_are_forgotten_after_the_window_and_bounded() -> None:
    nonces = relay_wire.Nonces(window_s=10, kept=3)
    assert nonces.fresh("a", 0) and not nonces.fresh("a", 5)
    assert nonces.fresh("a", 11)  # outside the window: a stale time is refused anyway
    for n in "bcd":
        assert nonces.fresh(n, 12)
    assert len(nonces._seen) == 3


def test_a_nonce_pushed_out_by_a_flood_cannot_be_replayed() -> None:
    """A relay that captured a request flooded requests of its own until the nonce was
    forgotten, then sent the captured one again inside the window: it was taken twice."""
    nonces = relay_wire.Nonces(window_s=300, kept=4)
    assert nonces.fresh("captured", now=100, signed_at=100, origin="honest")
    for i in range(4):  # the flood, signed later
        assert nonces.fresh(f"flood{i}", now=101, signed_at=101, origin="relay")
    assert "captured" not in nonces._seen
    assert not nonces.fresh("captured", now=102, signed_at=100, origin="honest")
    assert nonces.fresh("next", now=102, signed_at=102, origin="honest")


def test_a_flood_signed_ahead_of_time_refuses_nobody_else() -> None:
    """One floor for all, set from a signing time the flooder chose (up to the window
    ahead), refused every honest request for five minutes."""
    nonces = relay_wire.Nonces(window_s=300, kept=4)
    for i in range(8):  # (from the 5th on, refused: the flooder's own floor is 1299)
        nonces.fresh(f"f{i}", now=1000 + i, signed_at=1299, origin="stranger")
    assert nonces.floor("stranger") == 1299
    assert nonces.fresh("h", now=1008, signed_at=1007.5, origin="honest")


def test_an_origin_whose_clock_is_ahead_cannot_be_replayed_after_a_flood() -> None:
    """Its floor was capped at when its nonce came (100), below when it signed (101): the
    captured request, signed at 101, was taken again."""
    nonces = relay_wire.Nonces(window_s=300, kept=4)
    assert nonces.fresh("captured", now=100, signed_at=101, origin="ahead")
    for i in range(4):
        assert nonces.fresh(f"flood{i}", now=102, signed_at=102, origin="relay")
    assert not nonces.fresh("captured", now=103, signed_at=101, origin="ahead")
    # nor plainly, once the time it came is a window old but not the time it was signed
    nonces = relay_wire.Nonces(window_s=300, kept=4)
    assert nonces.fresh("n", now=100, signed_at=101, origin="ahead")
    assert not nonces.fresh("n", now=400.5, signed_at=101, origin="ahead")


def _answer(identity: Identity, nonce: str, frames: list[bytes]) -> bytes:
    signer = AnswerSigner(identity, nonce)
    for f in frames:
        signer.update(f)
    data = b"".join(_frame(streams.KIND_DATA, f) for f in frames)
    return data + _frame(streams.KIND_SIGNED, signer.finish()) + _frame(streams.KIND_END, b"")


async def _read(data: bytes, peer: str, nonce: str) -> list[bytes]:
    limits = (1 << 20, 4 << 20)
    return await relay_wire.read_signed(_reader(data), peer, "r" * 52, nonce, 5.0, limits)


async def test_the_caller_takes_only_an_answer_its_target_signed() -> None:
    target, nonce = Identity.generate(), os.urandom(16).hex()
    frames = [b"one", b"two" * 100]
    assert await _read(_answer(target, nonce, frames), target.peer_id, nonce) == frames
    altered = _answer(target, nonce, frames).replace(b"one", b"0ne")
    with pytest.raises(streams.StreamError, match="altered"):
        await _read(altered, target.peer_id, nonce)
    other = os.urandom(16).hex()  # the answer to another request, replayed
    with pytest.raises(streams.StreamError, match="altered"):
        await _read(_answer(target, other, frames), target.peer_id, nonce)
    by_relay = _answer(Identity.generate(), nonce, frames)  # signed by someone else
    with pytest.raises(streams.StreamError, match="altered"):
        await _read(by_relay, target.peer_id, nonce)
    unsigned = _frame(streams.KIND_DATA, b"one") + _frame(streams.KIND_END, b"")
    with pytest.raises(streams.StreamError, match="framing"):
        await _read(unsigned, target.peer_id, nonce)
    appended = _answer(target, nonce, frames)[: -1 - streams.LEN_BYTES]
    appended += _frame(streams.KIND_DATA, b"more") + _frame(streams.KIND_END, b"")
    with pytest.raises(streams.StreamError, match="framing"):
        await _read(appended, target.peer_id, nonce)


async def test_a_refusal_through_a_relay_is_not_taken_as_the_targets_word() -> None:
    """A refusal frame through a relay carries no signature: the relay's own, or the target
    refusing the relay, was read as the target refusing this node, and an admitted node
    stopped with the relay's text (admission.ask: Verdict.REFUSED)."""
    target, nonce = Identity.generate(), os.urandom(16).hex()
    forged = _frame(streams.KIND_REFUSED, b"this swarm admits only listed keys")
    with pytest.raises(streams.StreamError, match="unsigned") as caught:
        await _read(forged, target.peer_id, nonce)
    assert not isinstance(caught.value, streams.RefusedError)


async def test_an_answer_held_for_its_signature_is_bounded() -> None:
    """A relayed answer waits for the target's signature before any frame is used: a peer
    or relay sending frames without end is cut at the caller's total, not buffered."""
    target, nonce = Identity.generate(), os.urandom(16).hex()
    endless = b"".join(_frame(streams.KIND_DATA, b"x" * 4096) for _ in range(8))
    with pytest.raises(streams.StreamError, match="exceeds 16384 bytes"):
        await relay_wire.read_signed(
            _reader(endless), target.peer_id, "r" * 52, nonce, 5.0, (1 << 20, 16384)
        )


def test_a_header_is_strict() -> None:
    me = Identity.generate().peer_id
    good = Header(me, ECHO, 1, "0" * 32, "0" * 128)
    assert Header.decode(good.encode()) == good
    for bad in (
        b"[]",
        b'{"to": "x", "proto": "p", "t": 1, "nonce": "'
        + b"0" * 32
        + b'", "sig": "'
        + b"0" * 128
        + b'"}',
        good.encode().replace(b'"t":1', b'"t":true'),
        good.encode().replace(b'"t":1', b'"t":-1'),
        good.encode().replace(b"0" * 32, b"0" * 31),
        good.encode().replace(b'"sig":"0', b'"sig":"z'),
        b"\xff",
    ):
        with pytest.raises(RelayError):
            Header.decode(bad)


def test_routes_go_through_a_peers_relays_unless_it_is_connected_directly() -> None:
    me, nat, public, relay_id = (Identity.generate().peer_id for _ in range(4))
    relaying = Relaying(Identity.generate(), RUN)
    circuit = f"/ip4/1.2.3.4/tcp/1/p2p/{relay_id}/p2p-circuit/p2p/{nat}"
    addrs = {nat: ["/ip4/10.0.0.2/tcp/1", circuit], public: ["/ip4/1.2.3.5/tcp/1"], me: []}
    relaying.update_routes(addrs, direct=set())
    assert relaying.routes == {nat: [relay_id]}
    relaying.update_routes(addrs, direct={nat})  # it dialed us: its streams ride that
    assert relaying.routes == {}


class _Sink:
    """A stream writer that keeps what is written."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass


async def test_a_relay_copies_an_answer_up_to_its_last_frame_and_refuses_a_cut_one() -> None:
    answer = _frame(streams.KIND_DATA, b"x" * 5000) + _frame(streams.KIND_END, b"")
    sink = _Sink()
    moved = await relay_wire.copy_answer(
        _reader(answer + b"ignored"), sink, Guard("relay"), "caller", 1 << 20
    )
    assert bytes(sink.data) == answer and moved == len(answer)  # stops at END
    with pytest.raises(streams.StreamError, match="cut"):  # an answer cut short (p2pd did)
        await relay_wire.copy_answer(_reader(answer[:3000]), _Sink(), Guard("r"), "c", 1 << 20)
    with pytest.raises(RelayError) as err:
        await relay_wire.copy_answer(_reader(answer), _Sink(), Guard("r"), "c", 4096)
    assert err.value.code == "answer"
