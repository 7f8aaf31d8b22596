"""A private swarm (--allow-keys) refuses unlisted peers at every entry point, by the peer
id a signature or libp2p authenticates, and counts what it refused. Pure logic except the
last test, which runs two real libp2p peers on 127.0.0.1."""

from __future__ import annotations

import time

import pytest

from agora_node.comms.collective import GroupPlan, Matchmaker, MatchmakingConfig, MemoryBoard
from agora_node.comms.collective.entries import RoundEntry
from agora_node.comms.collective.handlers import NOT_LISTED, Responder
from agora_node.comms.collective.state import RoundBook
from agora_node.comms.collective.wire import Code, Header
from agora_node.comms.directory import Directory
from agora_node.protocol.allowlist import AllowList
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import outer_round_key
from agora_node.protocol.records import NodeRecord
from tests.p2p_peers import stop_p2p

pytestmark = pytest.mark.timeout(60)


def _allow(tmp_path, *identities: Identity) -> AllowList:
    path = tmp_path / "keys.txt"
    path.write_text("".join(i.peer_id + "\n" for i in identities))
    return AllowList(path)


def test_records_signed_by_unlisted_keys_are_never_read(tmp_path):
    listed, stranger = Identity.generate(), Identity.generate()
    allow = _allow(tmp_path, listed)
    d = Directory(None, None, "run0", 2, admit=allow.admit("record"))  # keep() needs no host
    now = time.time()
    raw = {
        i.peer_id: NodeRecord(run_id="run0", peer_id=i.peer_id, stage=0, issued_at=now).sign(i)
        for i in (listed, stranger)
    }
    kept = d.keep(0, raw, now=now)
    assert [r.peer_id for r in kept] == [listed.peer_id]
    assert allow.take_refused() == {"record": 1}
    assert sum(d.rejected.values()) == 0  # refused for who signed, not as a bad record


async def test_round_entries_of_unlisted_keys_do_not_count_and_cannot_crowd_out(tmp_path):
    me, other = Identity.generate(), Identity.generate()
    strangers = [Identity.generate() for _ in range(6)]
    allow = _allow(tmp_path, me, other)
    board = MemoryBoard()
    cfg = MatchmakingConfig(window=0.2, settle=0.1, poll_interval=0.02, max_entries=4)
    key = outer_round_key("r", 0, 1)
    now = time.time()
    for ident in [*strangers, other]:  # strangers first: they would fill max_entries
        entry = RoundEntry(peer_id=ident.peer_id, run_id="r", stage=0, round=1, joined_at=now)
        await board.publish(key, ident.peer_id, entry.sign(ident), now + 60)
    maker = Matchmaker(board, me, run_id="r", stage=0, config=cfg, admit=allow.admit("round_entry"))
    assert await maker.opened_by_others(1)  # the listed peer's entry, read past the strangers
    view = await maker.gather(1, expect=[me.peer_id, other.peer_id])
    assert set(view.peers) == {me.peer_id, other.peer_id}
    assert allow.take_refused()["round_entry"] >= 2 * len(strangers)


async def test_collective_requests_of_unlisted_peers_are_refused(tmp_path):
    me, member, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    allow = _allow(tmp_path, me, member)
    book = RoundBook(me.peer_id)
    plan = GroupPlan(
        round=0,
        phase="delta",
        members=(me.peer_id, member.peer_id, stranger.peer_id),
        numel=256,
        block=64,
    )
    book.register(plan)
    responder = Responder(book, admit=allow.admit("rpc"))
    header = Header(0, "delta", plan.group_id, 0, 0, weight=1.0)
    replies = [
        await responder.admit_push(stranger.peer_id, header, 10),
        await responder.on_push(stranger.peer_id, header, b"x"),
        await responder.on_fetch(stranger.peer_id, header),
        await responder.on_query(stranger.peer_id, Header(5, "delta", b"g" * 16, 0, 1)),
        await responder.on_check(stranger.peer_id, header, b"n" * 16),
    ]
    assert all(r.code is Code.REJECTED and r.reason == NOT_LISTED for r in replies)
    assert not book.pending  # a refused query leaves no promise behind
    assert await responder.admit_push(member.peer_id, header, 10) is None
    assert allow.take_refused() == {"rpc": 5}


@pytest.mark.integration
async def test_a_stream_from_an_unlisted_peer_gets_one_refusal_line(tmp_path):
    from hivemind.p2p import P2P

    from agora_node.comms import admission, streams

    server = client = None
    keys = {}
    for name in ("server", "client"):
        ident = keys[name] = Identity.generate()
        (tmp_path / f"{name}.key").write_bytes(ident.to_libp2p_bytes())
    try:
        server = await P2P.create(
            identity_path=str(tmp_path / "server.key"), host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )
        client = await P2P.create(
            identity_path=str(tmp_path / "client.key"),
            check_if_identity_free=False,  # hivemind's check parses RSA keys only
            initial_peers=await server.get_visible_maddrs(),
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        )
        me, them = keys["server"].peer_id, keys["client"].peer_id
        assert server.peer_id.to_base58() == me
        allow = _allow(tmp_path, keys["server"])
        handled = []

        async def echo(remote, request):  # noqa: ANN001, ANN202
            handled.append(remote)
            yield request

        refuse = admission.refuser(allow, me, "stream")
        await streams.serve(server, "/test/echo", echo, refuse=refuse)
        await admission.serve_admission(server, "run0", admission.refuser(allow, me, "admission"))
        with pytest.raises(streams.RefusedError) as refused:
            await streams.request(client, me, "/test/echo", b"hello", timeout=10)
        assert str(refused.value) == (
            f"this swarm admits only listed keys; {them} is not on {me}'s list"
        )
        assert handled == []  # the handler never saw the request
        verdict, reason = await admission.ask(client, "run0", me)
        assert verdict is admission.Verdict.REFUSED and reason == str(refused.value)
        assert allow.take_refused() == {"stream": 1, "admission": 1}
        allow.keys = frozenset({me, them})  # listed after a reload: served
        assert await streams.request(client, me, "/test/echo", b"hi", timeout=10) == b"hi"
        assert (await admission.ask(client, "run0", me))[0] is admission.Verdict.ADMITTED
    finally:
        for p2p in (client, server):
            if p2p is not None:
                await stop_p2p(p2p)
