"""Reachability's pure parts: what a prober agrees to dial, how often, and what the
answers of the peers asked add up to."""

from __future__ import annotations

import asyncio
import json

import pytest

from agora_node.comms import reachability as r
from agora_node.protocol.identity import Identity

pytestmark = pytest.mark.timeout(30)

ME = Identity.generate().peer_id
OTHER = Identity.generate().peer_id


def test_only_ip_addresses_of_the_asker_itself_are_dialed():
    good = ["/ip4/127.0.0.1/tcp/4001", f"/ip4/10.0.0.2/tcp/4001/p2p/{ME}", "/ip6/::1/tcp/9"]
    assert r.check_addrs(good, ME) == [
        "/ip4/127.0.0.1/tcp/4001",
        "/ip4/10.0.0.2/tcp/4001",
        "/ip6/::1/tcp/9",
    ]
    for bad, says in [
        ([], "1 to 8"),
        (["/ip4/1.2.3.4/tcp/1"] * 9, "1 to 8"),
        ("not a list", "1 to 8"),
        ([17], "short string"),
        (["/dns4/example.com/tcp/80"], "only IP addresses"),
        (["/ip4/1.2.3.4/tcp/1/p2p/" + OTHER], "another peer"),
        ([f"/ip4/1.2.3.4/tcp/1/p2p/{OTHER}/p2p-circuit/p2p/{ME}"], "another peer"),
        (["/ip4/1.2.3.4"], "only IP addresses"),
        (["nonsense"], "not a multiaddr"),
    ]:
        with pytest.raises(ValueError, match=says):
            r.check_addrs(bad, ME)


def test_the_prober_dials_no_address_of_its_own_networks_for_a_stranger_elsewhere():
    """A stranger asked it to dial 127.0.0.1:22, the home LAN or a cloud's metadata
    address, and read the answer (refused, timed out) back: a port scan by proxy. A node
    announces its loopback and LAN addresses beside its public one: those are left out."""
    public = ["/ip4/8.8.8.8/tcp/4001", "/ip6/2001:4860::8888/tcp/1"]
    near_only = {
        "/ip4/127.0.0.1/tcp/22": "loopback",
        "/ip4/192.168.1.1/tcp/80": "private",
        "/ip4/10.0.0.2/udp/4001/quic-v1": "private",
        "/ip4/169.254.169.254/tcp/80": "link-local",
        "/ip6/fe80::1/tcp/80": "link-local",
        "/ip4/0.0.0.0/tcp/80": "unspecified",
        "/ip4/224.0.0.1/udp/80": "multicast",
        "/ip6/::ffff:169.254.169.254/tcp/80": "link-local",  # IPv4-mapped: as its IPv4
        # neither private nor global (CGNAT, where tailnets live), or an IPv6 address a
        # dial to which ends at a private or loopback IPv4 (NAT64, 6to4, Teredo)
        "/ip4/100.100.100.100/tcp/80": "private",
        "/ip6/64:ff9b::a00:1/tcp/22": "private",
        "/ip6/64:ff9b::7f00:1/tcp/22": "loopback",
        "/ip6/2002:a00:1::1/tcp/22": "private",
        "/ip6/2001:0:4136:e378:8000:63bf:f5ff:fffe/udp/1": "private",  # Teredo: 10.0.0.1
        "/ip6/::7f00:1/tcp/22": "loopback",  # IPv4-compatible
        "/ip6/::1/tcp/22": "loopback",
        "/ip6/::/tcp/22": "unspecified",
        "/ip6/::ffff:0:7f00:1/tcp/22": "loopback",  # SIIT
        "/ip6/64:ff9b:1::a00:1/tcp/22": "private",  # local-use NAT64
        "/ip6/fec0::1/tcp/22": "private",  # site-local
    }
    for addr, scope in near_only.items():
        assert r.address_scope(addr) == scope
    # an asker connected from nowhere in particular: nothing is dialed
    assert r.in_reach(public + list(near_only)) == []
    # an asker is dialed only at the IP it is connected from (a test on one host, a LAN)
    assert r.in_reach(list(near_only), frozenset({"127.0.0.1"})) == ["/ip4/127.0.0.1/tcp/22"]
    assert r.in_reach(list(near_only), frozenset({"::1", "10.0.0.2"})) == [
        "/ip4/10.0.0.2/udp/4001/quic-v1",
        "/ip6/::1/tcp/22",
    ]
    # never link-local, multicast or unspecified, even from there
    never = frozenset({"169.254.169.254", "fe80::1", "0.0.0.0", "224.0.0.1"})
    assert r.in_reach(list(near_only), never) == []
    # nothing left to dial, seen at a public IPv4 while announcing IPv4 (a NAT without a
    # forwarded port): an answer that says so (unreachable), not "bad request"
    lan_only = json.dumps({"addrs": ["/ip4/192.168.1.1/tcp/80"]}).encode()

    async def seen_at(*ips: str):  # noqa: ANN202
        return frozenset(ips)

    def ask(*ips: str) -> bytes:
        return asyncio.run(r.Prober().answer(ME, lan_only, lambda: seen_at(*ips)))

    assert ask("81.2.69.142").startswith(r.FAILED + b"none of its addresses")
    # no verdict where nothing follows: no direct connection (a relay), only the other
    # family (connected over IPv6, announcing IPv4), a private network (a cloud VPC)
    for ips in [(), ("2a01:4f8:1:2::5",), ("10.0.0.9",)]:
        assert ask(*ips).startswith(r.UNJUDGED), ips


def test_a_stranger_cannot_have_a_third_partys_port_dialed_and_its_words_are_quoted():
    """Any public address used to be dialed, and the dial's error (refused, a failed
    handshake, a timeout) told the asker whether a port of someone else was open: a port
    scan by proxy. Only addresses at the IP the asker is connected from are dialed now."""
    third_party = ["/ip4/8.8.8.8/tcp/22", "/ip6/2001:4860::8888/tcp/80"]
    asker_at = frozenset({"81.2.69.142"})
    assert r.in_reach(third_party + ["/ip4/81.2.69.142/tcp/4001"], asker_at) == [
        "/ip4/81.2.69.142/tcp/4001"
    ]
    prober = r.Prober()

    async def connected() -> frozenset[str]:
        return asker_at

    answer = asyncio.run(prober.answer(ME, json.dumps({"addrs": third_party}).encode(), connected))
    assert b"81.2.69.142" in answer and b"not dialed" in answer and prober._p2p is None
    assert r.ip_of("/ip6/2001:4860:0::8888/tcp/80") == "2001:4860::8888"
    # IPv6: a host connects out from a temporary address and announces its stable one
    stable = "/ip6/2a01:4f8:1:2:abcd::1/tcp/4001"
    assert r.in_reach([stable], frozenset({"2a01:4f8:1:2:9f3e:11:22:33"})) == [stable]
    assert r.in_reach([stable], frozenset({"2a01:4f8:1:3::1"})) == []  # another /64
    assert r.ip_of("/dns4/example.com/tcp/1") is None


def test_a_prober_dials_each_peer_at_most_once_per_cooldown_and_one_at_a_time():
    now = [0.0]
    prober = r.Prober(clock=lambda: now[0])
    assert prober.admit(ME)
    assert not prober.admit(ME)  # within its cooldown
    assert prober.admit(OTHER)
    now[0] = r.COOLDOWN_S + 1
    assert prober.admit(ME)

    async def while_dialing() -> bool:
        async with prober._lock:  # a dial under way
            return prober.admit(Identity.generate().peer_id)

    assert not asyncio.run(while_dialing())


def test_a_bad_request_is_refused_before_anything_is_dialed():
    prober = r.Prober()
    requests = (
        b"\xff",
        b"[]",
        json.dumps({"addrs": ["/dns4/x/tcp/1"]}).encode(),
        b"[" * 5000,  # RecursionError in json: was logged with a traceback per request
    )
    for request in requests:
        answer = asyncio.run(prober.answer(ME, request))
        assert answer.startswith(r.FAILED + b"bad request")
    assert prober.dials["refused"] == 4 and prober._p2p is None  # no probe daemon started


def test_one_dial_back_makes_a_node_reachable_and_silence_changes_nothing():
    reach = r.Reachability()
    reach.note({"a": (None, "gone"), "b": (None, "busy")}, now=1.0)
    assert reach.state == r.Reach.UNKNOWN and reach.due(2.0)
    reach.note({"a": (False, "refused"), "b": (False, "timeout")}, now=2.0)
    assert reach.state == r.Reach.UNREACHABLE and reach.failed == {"a": "refused", "b": "timeout"}
    assert "NOT reachable: 2 peer(s)" in reach.line()
    assert not reach.due(3.0) and reach.due(2.0 + r.RECHECK_S)
    reach.note({"a": (False, "refused"), "c": (True, "")}, now=5.0)
    assert reach.state == r.Reach.REACHABLE and reach.dialed_by == ["c"]
    reach.note({"a": (None, "gone")}, now=6.0)  # no answers: keep what we knew
    assert reach.state == r.Reach.REACHABLE and reach.checked_at == 5.0
    assert reach.status()["state"] == "reachable"


def test_bootstrap_peers_are_asked_too_and_probes_listen_where_the_node_does():
    boot = f"/ip4/10.0.0.1/tcp/31337/p2p/{OTHER}"
    assert r.peer_ids([boot, "/ip4/10.0.0.2/tcp/1"]) == {OTHER}
    # what the DHT dials an initial peer at (Host.meet): without the /p2p/ID p2pd refuses
    also = f"/ip4/10.0.0.3/udp/5/quic/p2p/{OTHER}"
    assert r.addrs_by_peer([boot, also, f"/p2p/{OTHER}", "/ip4/10.0.0.2/tcp/1"]) == {
        OTHER: ["/ip4/10.0.0.1/tcp/31337", "/ip4/10.0.0.3/udp/5/quic"]
    }
    assert r.probe_listen(["/ip4/127.0.0.1/tcp/31337"]) == "/ip4/127.0.0.1/tcp/0"
    assert r.probe_listen(["/ip6/::/tcp/5"]) == "/ip6/::/tcp/0"
    assert r.probe_listen([]) == "/ip4/127.0.0.1/tcp/0"


def test_a_dial_back_answer_is_quoted_before_it_reaches_the_log(monkeypatch):
    """A stranger's "failed: ..." went into a WARNING line as sent: newlines (forged log
    lines) and terminal escapes included."""

    async def request(*_args, **_kwargs) -> bytes:
        return r.FAILED + b"x\n2026-12-06 CRITICAL forged line \x1b]0;title\x07" + b"y" * 900

    monkeypatch.setattr(r.streams, "request", request)
    ok, why = asyncio.run(r.ask(None, "run", OTHER, ["/ip4/1.2.3.4/tcp/1"]))
    assert ok is False and "\n" not in why and "\x1b" not in why and len(why) < 400
    reach = r.Reachability()
    reach.note({OTHER: (ok, why)}, now=1.0)
    assert "\n" not in reach.line()


def test_a_prober_that_cannot_tell_gives_no_verdict(monkeypatch):
    async def request(*_args, **_kwargs) -> bytes:
        return r.UNJUDGED + b"it connects from no direct connection, none of its addresses"

    monkeypatch.setattr(r.streams, "request", request)
    ok, _why = asyncio.run(r.ask(None, "run", OTHER, ["/ip4/1.2.3.4/tcp/1"]))
    assert ok is None  # neither reachable nor not: the next peer's answer decides
