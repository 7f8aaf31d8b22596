"""The allow-list file of a private swarm: parsing, clear errors, reloading, counting."""

from __future__ import annotations

import os

import pytest

from agora_node.comms.admission import Admission, Verdict
from agora_node.protocol.allowlist import (
    AllowList,
    AllowListError,
    parse_allow_keys,
    refusal_message,
)
from agora_node.protocol.identity import Identity

pytestmark = pytest.mark.timeout(30)


def test_peer_ids_and_hex_public_keys_with_comments_and_blank_lines():
    a, b = Identity.generate(), Identity.generate()
    text = f"# the swarm\n\n{a.peer_id}   # node a\n  {b.public_raw.hex()}\n{a.peer_id}\n"
    assert parse_allow_keys(text) == {a.peer_id, b.peer_id}


@pytest.mark.parametrize(
    ("text", "line", "why"),
    [
        ("12D3KooWnotapeerid\n", 1, "neither an Ed25519 peer id"),
        ("# ok\n\nQmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N\n", 3, "neither"),
        ("{a} {a}\n", 1, "one key per line"),
        ("{a}\n" + "ab" * 31 + "\n", 2, "neither"),  # 62 hex digits: not a key
    ],
)
def test_a_bad_line_is_reported_as_file_and_line(text, line, why):
    text = text.format(a=Identity.generate().peer_id)
    with pytest.raises(AllowListError, match=f"^keys.txt:{line}: .*{why}"):
        parse_allow_keys(text, "keys.txt")


def test_an_empty_or_missing_file_is_an_error(tmp_path):
    with pytest.raises(AllowListError, match="lists no key"):
        parse_allow_keys("# nobody\n\n", "keys.txt")
    with pytest.raises(AllowListError, match="no such allow-keys file"):
        AllowList(tmp_path / "absent.txt")


def test_check_counts_refusals_by_kind_and_take_resets():
    a, b = Identity.generate(), Identity.generate()
    allow = _write_list(a.peer_id)
    assert allow.check(a.peer_id, "record")
    assert not allow.check(b.peer_id, "record")
    assert not allow.admit("stream")(b.peer_id)
    assert allow.take_refused() == {"record": 1, "stream": 1}
    assert allow.take_refused() == {}


def test_reload_when_the_file_changes_and_a_bad_edit_keeps_the_old_list(tmp_path):
    a, b = Identity.generate(), Identity.generate()
    path = tmp_path / "keys.txt"
    path.write_text(a.peer_id + "\n")
    allow = AllowList(path)
    assert not allow.reload_if_changed()  # unchanged: not re-read
    path.write_text(f"{a.peer_id}\n{b.peer_id}\n")
    _touch_later(path, 1)
    assert allow.reload_if_changed() and b.peer_id in allow
    path.write_text(f"{a.peer_id}\nbroken\n")
    _touch_later(path, 2)
    with pytest.raises(AllowListError, match=r"keys.txt:2: "):
        allow.reload_if_changed()
    assert allow.keys == {a.peer_id, b.peer_id}
    assert not allow.reload_if_changed()  # a bad file is reported once, not on every check
    path.write_text(f"{b.peer_id}\n")
    _touch_later(path, 3)
    assert allow.reload_if_changed() and a.peer_id not in allow


def test_the_refusal_names_both_peers():
    assert refusal_message("12D3KooWa", "12D3KooWb") == (
        "this swarm admits only listed keys; 12D3KooWa is not on 12D3KooWb's list"
    )


def test_refusals_never_outweigh_an_admission():
    """In an open swarm a stranger can publish many records and refuse from each: one
    honest admission keeps the joiner, however many refuse."""
    adm = Admission(recheck_s=60)
    peers = ["p1", "p2", "p3", "p4", "p5"]
    assert adm.to_ask(peers, now=0) == peers
    adm.note("p1", Verdict.REFUSED, "no from p1", now=0)
    adm.note("p2", Verdict.ADMITTED, "", now=0)
    adm.note("p3", Verdict.UNKNOWN, "", now=0)
    for sybil in ("p4", "p5"):
        adm.note(sybil, Verdict.REFUSED, f"no from {sybil}", now=0)
    assert adm.refusal() is None  # 3 refusals, 1 admission: kept


def test_refused_only_when_every_peer_seen_was_asked_and_none_admitted():
    adm = Admission(recheck_s=60)
    assert adm.to_ask(["p1", "p2", "p3"], now=0, limit=2) == ["p1", "p2"]
    adm.note("p1", Verdict.REFUSED, "no from p1", now=0)
    adm.note("p2", Verdict.REFUSED, "no from p2", now=0)
    assert adm.refusal() is None  # p3 not asked yet: it may admit us
    assert adm.to_ask(["p1", "p2", "p3"], now=1) == ["p3"]  # never asked first
    adm.note("p3", Verdict.UNKNOWN, "", now=1)  # no answer: maybe an honest peer kept busy
    assert adm.refusal() is None
    adm.note("p3", Verdict.REFUSED, "no from p3", now=2)
    assert adm.refusal() == "no from p1"


def test_a_peer_that_never_answers_does_not_keep_an_unlisted_joiner_waiting():
    """An older peer without the protocol, or one the joiner cannot dial, stays silent
    while its record is republished: the joiner waited for ever."""
    from agora_node.comms.admission import SILENT_ASKS

    adm = Admission(recheck_s=60)
    adm.to_ask(["p1", "old"], now=0)
    adm.note("p1", Verdict.REFUSED, "no from p1", now=0)
    for i in range(SILENT_ASKS):
        assert adm.refusal() is None
        adm.note("old", Verdict.UNKNOWN, "", now=i)
    assert adm.refusal() == "no from p1"
    busy = Admission(recheck_s=60)  # a peer kept busy (by a stranger, say) is no silence
    busy.to_ask(["p1", "honest"], now=0)
    busy.note("p1", Verdict.REFUSED, "no from p1", now=0)
    for i in range(3 * SILENT_ASKS):
        busy.note("honest", Verdict.BUSY if i % 2 else Verdict.UNKNOWN, "", now=i)
        assert busy.refusal() is None
    adm.note("p1", Verdict.ADMITTED, "", now=20)  # once admitted, silence never counts
    adm.note("p1", Verdict.REFUSED, "no from p1", now=90)
    assert adm.refusal() is None  # "old" is silent: it may still admit us


def test_strangers_alone_never_stop_a_node_that_was_admitted():
    """A stranger with a record answers "refused"; an honest peer that admitted the node
    once gives no answer now (busy, or gone): the node quit, in an open swarm."""
    adm = Admission(recheck_s=60)
    adm.to_ask(["honest"], now=0)
    adm.note("honest", Verdict.ADMITTED, "", now=0)
    adm.to_ask(["honest", "stranger"], now=61)
    adm.note("stranger", Verdict.REFUSED, "not on my list", now=61)
    adm.note("honest", Verdict.UNKNOWN, "", now=61)
    assert adm.refusal() is None
    adm.to_ask(["stranger"], now=62)  # the honest peer left the directory
    assert adm.refusal() is None
    adm.to_ask(["stranger", "honest"], now=130)
    adm.note("honest", Verdict.REFUSED, "removed from the list", now=130)
    assert adm.refusal() == "removed from the list"


def test_admitted_peers_are_asked_again_and_gone_peers_forgotten():
    adm = Admission(recheck_s=60)
    adm.to_ask(["p1", "p2"], now=0)
    adm.note("p1", Verdict.ADMITTED, "", now=0)
    adm.note("p2", Verdict.ADMITTED, "", now=30)
    assert adm.to_ask(["p1", "p2"], now=59) == []
    assert adm.to_ask(["p1", "p2"], now=60) == ["p1"]  # removed from a list since? ask
    adm.note("p1", Verdict.REFUSED, "removed", now=60)
    assert adm.refusal() is None  # p2 still admits us
    adm.to_ask(["p1"], now=61)  # p2 left the directory: its old "admitted" no longer counts
    assert adm.refusal() == "removed"


def _write_list(*peer_ids: str) -> AllowList:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(peer_ids) + "\n")
    try:
        return AllowList(f.name)
    finally:
        os.unlink(f.name)


def _touch_later(path, seconds: int) -> None:  # noqa: ANN001
    """Move the file's modification time `seconds` ahead (increasing per edit), so that edits
    within one tick of a coarse filesystem clock still differ."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def test_a_guard_turning_the_ask_away_is_busy_not_silence(monkeypatch):
    import asyncio

    from agora_node.comms import admission, streams

    async def turned_away(*_a, **_k):  # noqa: ANN202
        raise streams.StreamError("peer1234 failed: refused (peer_streams): 8 already")

    async def silent(*_a, **_k):  # noqa: ANN202
        raise streams.StreamError("peer1234 sent nothing for 3s")

    monkeypatch.setattr(streams, "request", turned_away)
    assert asyncio.run(admission.ask(None, "run", "peer"))[0] == Verdict.BUSY
    monkeypatch.setattr(streams, "request", silent)
    assert asyncio.run(admission.ask(None, "run", "peer"))[0] == Verdict.UNKNOWN
