"""Remembered peers (node/peerbook.py): what a restart may dial besides --initial-peers."""

from __future__ import annotations

import json

from agora_node.node import peerbook
from agora_node.node.peerbook import MAX_ADDRS, MAX_PEERS, SAVE_EVERY_S, PeerBook
from agora_node.protocol.identity import Identity
from agora_node.protocol.records import NodeRecord

IDS = sorted(Identity.generate().peer_id for _ in range(MAX_PEERS + 3))


def _record(peer: str, state: str = "active", addrs: list[str] | None = None) -> NodeRecord:
    if addrs is None:
        addrs = ["/ip4/127.0.0.1/tcp/4001"]
    return NodeRecord(run_id="r", peer_id=peer, stage=0, state=state, addrs=addrs)


def test_pick_takes_one_address_of_each_other_active_peer_naming_that_peer():
    me, a, b, c, d, e = IDS[:6]
    relayed = f"/ip4/127.0.0.1/tcp/5/p2p/{a}/p2p-circuit/p2p/{e}"
    records = [
        _record(me),
        _record(a, addrs=["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"]),
        _record(b, addrs=[f"/ip4/127.0.0.1/tcp/3/p2p/{a}", f"/ip4/127.0.0.1/tcp/4/p2p/{b}"]),
        _record(c, state="leaving"),
        _record(d, addrs=["not a multiaddr"]),
        _record(e, addrs=[relayed, f"/ip4/127.0.0.1/tcp/6/p2p/{e}"]),  # a relay's: skipped
    ]
    assert sorted(peerbook.pick(records, me)) == sorted([
        f"/ip4/127.0.0.1/tcp/1/p2p/{a}",
        f"/ip4/127.0.0.1/tcp/4/p2p/{b}",
        f"/ip4/127.0.0.1/tcp/6/p2p/{e}",
    ])  # fmt: skip
    many = peerbook.pick([_record(p) for p in IDS], IDS[0], b"salt")
    assert len(many) == MAX_PEERS and many == peerbook.pick(
        [_record(p) for p in IDS], IDS[0], b"salt"
    )


def test_peers_whose_ids_sort_first_do_not_take_every_place():
    """Ids ground to sort low (free to make) got all eight places when peers were taken by id;
    with a node's secret salt they get places like any other peer."""
    ground = sorted(IDS)[:MAX_PEERS]
    others = [Identity.generate().peer_id for _ in range(4 * MAX_PEERS)]
    records = [_record(p) for p in ground + others]
    for salt in (b"a", b"b", b"c"):
        chosen = [a.rsplit("/", 1)[1] for a in peerbook.pick(records, "me", salt)]
        assert not set(chosen) <= set(ground), chosen


def test_peers_that_answered_come_before_a_flood_of_records_with_no_host_behind_them():
    """100 strangers' records (self-declared active, free to publish) beside 8 peers that
    answered the node's own probes: the 8 take every place, whatever the salt; without
    that evidence the salt alone gave strangers most places."""
    honest = [Identity.generate().peer_id for _ in range(MAX_PEERS)]
    strangers = [Identity.generate().peer_id for _ in range(100)]
    records = [_record(p) for p in strangers + honest]
    for salt in (b"a", b"b", b"c"):
        chosen = {
            a.rsplit("/", 1)[1]
            for a in peerbook.pick(records, "me", salt, set(honest).__contains__)
        }
        assert chosen == set(honest)
    blind = [
        {a.rsplit("/", 1)[1] for a in peerbook.pick(records, "me", salt)}
        for salt in (b"a", b"b", b"c")
    ]
    assert all(c - set(honest) for c in blind), blind  # strangers in each (1 - 2e-12)
    # fewer answering than places: the rest by the salt, as before
    few = {
        a.rsplit("/", 1)[1]
        for a in peerbook.pick(records, "me", b"a", set(honest[:3]).__contains__)
    }
    assert set(honest[:3]) <= few and len(few) == MAX_PEERS


def test_load_is_bounded_and_a_bad_file_means_no_remembered_peers(tmp_path):
    path = tmp_path / peerbook.FILE_NAME
    assert peerbook.load(tmp_path) == []  # none yet
    good = [f"/ip4/127.0.0.1/tcp/{i}/p2p/{p}" for i, p in enumerate(IDS + IDS, 1)]
    path.write_text(json.dumps(["/ip4/127.0.0.1/tcp/9", 7, "x" * 300, *good]))
    assert peerbook.load(tmp_path) == good[:MAX_ADDRS]  # no peer id, not a string, too long
    for bad in ("{", json.dumps({"a": 1}), json.dumps(["y" * 100] * 200)):
        path.write_text(bad)
        assert peerbook.load(tmp_path) == []


def test_a_book_saves_changes_at_most_every_interval_and_never_forgets_on_an_empty_view(tmp_path):
    now = [1000.0]
    book = PeerBook(tmp_path, clock=lambda: now[0])
    given = [f"/ip4/10.0.0.1/tcp/1/p2p/{IDS[9]}"]
    assert book.initial_peers(given) == given
    assert book.update([_record(IDS[1]), _record(IDS[2])], IDS[0])
    first = peerbook.load(tmp_path)
    assert len(first) == 2
    assert not book.update([_record(IDS[1])], IDS[0])  # changed, but too soon
    now[0] += SAVE_EVERY_S
    assert not book.update([], IDS[0])  # an empty view keeps what was remembered
    assert book.update([_record(IDS[1])], IDS[0])
    only = [a for a in first if a.endswith(IDS[1])]  # the order of `first` is the salt's
    assert peerbook.load(tmp_path) == only
    restarted = PeerBook(tmp_path)
    assert restarted.initial_peers(given) == given + only
    assert restarted.initial_peers(only) == only  # no duplicates


def test_a_bootstrap_s_book_is_a_file_of_its_own(tmp_path):
    """A bootstrap may share its data dir with a node (of another run, say)."""
    node = PeerBook(tmp_path)
    boot = PeerBook(tmp_path, file_name=peerbook.BOOTSTRAP_FILE_NAME)
    assert node.update([_record(IDS[1])], IDS[0]) and boot.update([_record(IDS[2])], IDS[0])
    assert [a[-len(IDS[1]) :] for a in peerbook.load(tmp_path)] == [IDS[1]]
    restarted = PeerBook(tmp_path, file_name=peerbook.BOOTSTRAP_FILE_NAME)
    assert [a[-len(IDS[2]) :] for a in restarted.saved] == [IDS[2]]


def test_the_address_remembered_is_the_most_dialable_and_never_one_of_no_peer():
    """A record lists its addresses in any order (a node on 0.0.0.0 may list loopback
    first), and a stranger's may list addresses that are no peer's. Beside a public
    address the best private one is kept: hosts behind the same NAT may not reach it."""
    suffix = f"/p2p/{IDS[1]}"
    loopback, lan, public = "/ip4/127.0.0.1/tcp/1", "/ip4/192.168.1.5/tcp/3", "/ip4/1.2.3.4/tcp/4"
    name = "/dns4/node.example/tcp/5"
    nobody = [
        "/ip4/169.254.169.254/tcp/80",
        "/ip4/0.0.0.0/tcp/2",
        "/ip4/224.0.0.1/tcp/5",
        "/ip6zone/eth0/ip6/fe80::1/tcp/6",
    ]
    for addrs, chosen in [
        ([loopback, *nobody, name, lan, public], [public, lan]),
        ([loopback, name, public], [public]),
        ([loopback, name, lan], [lan]),
        ([loopback, name], [name]),
        ([loopback], [loopback]),
        (nobody, []),
    ]:
        found = peerbook.pick([_record(IDS[1], addrs=addrs)], IDS[0])
        assert found == [a + suffix for a in chosen], (addrs, found)
