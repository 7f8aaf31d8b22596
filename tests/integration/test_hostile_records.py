"""A stranger with a fresh key against the directory and the run pointer, with real daemons.

The hostile peer is a plain hivemind DHT peer in the test process with its own
Ed25519 identity (and none of the daemon's DHT checks): everything it stores is
correctly signed by that key, copied from a real node, or junk. Values under a peer's
subkey meet the honest nodes' DHTs first (protocol/storable.py: signed by that peer,
not outliving themselves); what passes meets records.verify_record,
records.verify_run_pointer and the directory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import TestSwarm, poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _cli(*argv: str, timeout: float) -> tuple[int, str, float]:
    """Run `agora-node ARGV` in its own session; (exit code, output, seconds). Its process
    group is killed by pid whatever happens."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agora_node", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _rejected(swarm: TestSwarm, node) -> dict[str, int]:
    return (swarm.status(node) or {}).get("records_rejected", {})


def _raw_signed(identity, body: dict) -> dict[str, bytes]:
    data = json.dumps(body, allow_nan=True).encode()  # what a hostile peer may sign
    return {"r": data, "s": identity.sign(data)}


@pytest.mark.slow  # 90 s; the default suite has forged records among real daemons in
# tests/integration/test_daemon.py and thousands of hostile records in tests/foundation
def test_hostile_peer_records_and_run_pointers_are_ignored(swarm, tmp_path):
    import hivemind
    from hivemind.utils import get_dht_time

    from agora_node.protocol.identity import Identity
    from agora_node.protocol.manifest import parse_manifest
    from agora_node.protocol.names import manifest_key, run_pointer_key, stage_key
    from agora_node.protocol.records import MAX_CLOCK_SKEW_S, NodeRecord, RunPointer

    manifest = small_manifest(tmp_path / "two.toml", stages=2, layers=2)
    swarm.bootstrap(manifest)
    node0 = swarm.join("node-0", "--stage", "0")
    node1 = swarm.join("node-1", "--stage", "1")
    leaver = swarm.join("node-2", "--stage", "1")
    for node in (node0, node1, leaver):
        swarm.serving(node, timeout=180)

    def active(children):
        statuses = [swarm.status(c) for c in children]
        return statuses if all(s and s["state"] == "active" for s in statuses) else []

    s0, s1, s2 = poll(lambda: active([node0, node1, leaver]), 120, "3 active nodes")
    run_id, honest = s0["run_id"], [node0, node1]
    honest_ids = {s0["peer_id"], s1["peer_id"]}

    attacker, attacker2 = Identity.generate(), Identity.generate()
    dht = hivemind.DHT(initial_peers=swarm.initial_peers, start=True)
    try:
        # (b) a real node's signed "active, stage 1" record, kept for later.
        def leavers_active_record():
            found = dht.get(stage_key(run_id, 1), latest=True)
            entry = (found.value if found else {}).get(s2["peer_id"])
            if entry is None:
                return None
            record = json.loads(entry.value["r"])
            return (entry.value, record) if record["state"] == "active" else None

        replay, replay_body = poll(leavers_active_record, 30, "node-2's signed active record")
        swarm.kill(leaver)  # SIGKILL: it never withdraws; its record expires (ttl 6 s)
        poll(lambda: leaver.proc.poll() is not None, 30, "node-2 gone")
        stale_at = replay_body["issued_at"] + replay_body["ttl"] + MAX_CLOCK_SKEW_S + 1
        poll(lambda: time.time() > stale_at, 60, "the captured record to be past its lifetime")

        exp = get_dht_time() + 120
        # (a) infinite and absurd throughput, signed by the attacker's own keys (lifetimes
        # of 300 s: the DHT stores them, the readers' checks must refuse them);
        inf = NodeRecord(
            run_id=run_id, peer_id=attacker.peer_id, stage=0, state="active", ttl=300.0
        )
        body = {**json.loads(inf.canonical_bytes()), "throughput": math.inf}
        assert dht.store(
            stage_key(run_id, 0), _raw_signed(attacker, body), exp, subkey=attacker.peer_id
        )
        huge = NodeRecord(
            run_id=run_id,
            peer_id=attacker2.peer_id,
            stage=1,
            state="active",
            throughput=1e300,
            ttl=300.0,
        )
        assert dht.store(stage_key(run_id, 1), huge.sign(attacker2), exp, subkey=attacker2.peer_id)
        # (b) the replay, re-stored with a fresh expiry (only the attacker's own DHT keeps
        # it: the honest nodes' refuse a value past its lifetime);
        dht.store(stage_key(run_id, 1), replay, exp, subkey=s2["peer_id"])
        # (c) forged run pointers: unsigned (what main stores) and signed by the wrong key
        # (the honest DHTs refuse both; only the attacker's keeps them).
        dht.store(run_pointer_key(), b"hijack", exp, subkey="f" * 16)
        wrong = RunPointer(run_id="e" * 16, name="free", publisher=attacker.peer_id).sign(attacker)
        wrong["s"] = attacker2.sign(wrong["r"])
        dht.store(run_pointer_key(), wrong, exp, subkey="e" * 16)

        labels = ("nonfinite", "range")

        def counted_everywhere():
            counts = [_rejected(swarm, n) for n in honest]
            return counts if all(all(c.get(k, 0) > 0 for k in labels) for c in counts) else None

        before = poll(counted_everywhere, 60, "every honest node counting every forged value")

        def views_clean():
            views = [swarm.peers(n) for n in honest]
            return all(v is not None and {p["peer_id"] for p in v} == honest_ids for v in views)

        poll(views_clean, 30, "views of the two honest nodes only")
        steps = swarm.status(node0)["inner_step"]

        # More reads, and the views stay clean; the replay never reached an honest reader.
        def reread():
            counts = [_rejected(swarm, n) for n in honest]
            return all(c["range"] >= b["range"] + 2 for c, b in zip(counts, before, strict=True))

        poll(reread, 60, "two more directory reads")
        assert views_clean()
        never = ("stale", "run_pointer_not", "run_pointer_signature")  # refused by the DHTs
        assert all(_rejected(swarm, n).get(k, 0) == 0 for n in honest for k in never)

        # (d) Squatting: junk, and a copy of node-1's own signed record, stored under its
        # subkey to live an hour. Had the honest DHTs kept them, node-1's next stores (6 s
        # expiry) would be refused and its record would vanish from every view within a
        # record lifetime; they refuse them, and node-1 stays in view past that lifetime.
        own = dht.get(stage_key(run_id, 1), latest=True).value[s1["peer_id"]].value
        far = get_dht_time() + 3600
        dht.store(stage_key(run_id, 1), b"squat", far, subkey=s1["peer_id"])
        dht.store(stage_key(run_id, 1), own, far, subkey=s1["peer_id"])
        squatted_at = time.monotonic()
        lifetime = json.loads(own["r"])["ttl"]
        while time.monotonic() < squatted_at + lifetime + 3:  # + a view refresh or two
            assert views_clean(), [swarm.peers(n) for n in honest]
            time.sleep(0.5)
        # Training goes on through the stage the replay tried to re-populate.
        poll(lambda: swarm.status(node0)["inner_step"] >= steps + 2, 120, "inner steps going on")

        # A joiner without --manifest is not blocked by forged pointers, and its placement
        # sees exactly the honest replicas (not the infinite one, not the replayed one).
        base = ["join", "--initial-peers", *swarm.initial_peers, "--dry-run"]
        code, out, _ = _cli(*base, "--data-dir", str(tmp_path / "dry"), timeout=120)
        assert code == 0, out[-2000:]
        assert f"run {run_id}" in out and "stage 0: 1 node(s), stage 1: 1 node(s)" in out, out

        # A second, valid run (signed by its publisher, manifest in the DHT): a joiner
        # without --manifest gets one line listing both runs, at once, not a hang.
        other_text = Path(manifest).read_text().replace('name = "tiny"', 'name = "other-run"')
        other = parse_manifest(other_text)
        assert dht.store(manifest_key(other.run_id), other.canonical_bytes(), exp)
        pointer = RunPointer(run_id=other.run_id, name="other-run", publisher=attacker.peer_id)
        assert dht.store(run_pointer_key(), pointer.sign(attacker), exp, subkey=other.run_id)
        poll(
            lambda: len((swarm.status(node0) or {}).get("runs_seen", [])) == 2,
            60,  # the runs announced are re-read every 30 s (daemon.MANIFEST_REFRESH_S)
            "the status page listing both runs",
        )
        argv = ["join", "--initial-peers", *swarm.initial_peers, "--status-port", "0"]
        code, out, took = _cli(*argv, "--data-dir", str(tmp_path / "two"), timeout=120)
        errors = [line for line in out.splitlines() if "error" in line.lower()]
        assert code != 0 and "Traceback" not in out, out[-2000:]
        assert len(errors) == 1, out[-2000:]
        for needle in (run_id, "'tiny'", other.run_id, "'other-run'", "--run", "--manifest"):
            assert needle in errors[0], errors[0]
        assert "f" * 16 not in errors[0] and "e" * 16 not in errors[0]
        assert took < 60, f"took {took:.0f}s"
        # --run chooses.
        code, out, _ = _cli(*base, "--run", run_id, "--data-dir", str(tmp_path / "c"), timeout=120)
        assert code == 0 and f"run {run_id}" in out, out[-2000:]
        # The honest nodes never stopped.
        assert all(n.proc.poll() is None for n in honest)
    finally:
        dht.shutdown()
