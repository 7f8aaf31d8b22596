"""The daemon with real peers on 127.0.0.1: placement, state transfer, leaving, crashes, trust."""

import resource
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.harness import FAST, TestSwarm, poll, small_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _active(swarm: TestSwarm, children) -> list[dict]:
    statuses = [swarm.status(c) for c in children]
    return statuses if all(s and s["state"] == "active" for s in statuses) else []


@pytest.mark.slow  # 85-90 s; the default suite has placement in tests/policy and
# tests/node/test_measured_placement.py, and a restart that resumes in the test below
def test_auto_placement_spreads_then_bootstrap_dies_and_newcomer_copies_state(swarm, tmp_path):
    manifest = small_manifest(tmp_path / "three.toml", stages=3, layers=6)
    swarm.bootstrap(manifest)
    nodes = [swarm.join(f"node-{i}") for i in range(4)]  # all at once
    for node in nodes:
        swarm.serving(node)
    statuses = poll(lambda: _active(swarm, nodes), 120, "4 active nodes")
    # Every stage is served and none holds half the swarm. Placement balances measured
    # capacity, not counts: daemons sharing two cores measure compute rates up to ~2x
    # apart, so the exact split of equal joiners is checked where the rates are given
    # (tests/policy/test_choose_stage.py).
    counts = sorted(sum(1 for s in statuses if s["stage"] == k) for k in range(3))
    assert counts == [1, 1, 2], [s["stage"] for s in statuses]

    # The bootstrap peer dies: the others keep seeing each other...
    swarm.kill(swarm.children[0])
    swarm.children[0].proc.wait(timeout=30)
    ids = {s["peer_id"] for s in statuses}
    for node in nodes:  # records are re-read every second and live 6 s: wait past one expiry
        poll(
            lambda n=node: {p["peer_id"] for p in swarm.peers(n) or []} >= ids,
            30,
            "full view after bootstrap death",
        )

    # ...and a newcomer joins through any survivor, copying a live replica's state.
    survivor = statuses[3]
    newcomer = swarm.join("newcomer", initial_peers=survivor["addrs"][:1])
    swarm.serving(newcomer)
    mine = poll(
        lambda: (s := swarm.status(newcomer)) and s["state"] == "active" and s,
        120,
        "newcomer active",
    )
    origin = mine["state_origin"]
    assert origin["kind"] == "replica"
    source = next(n for n in nodes if swarm.status(n)["peer_id"] == origin["source"])
    served = [x["anchor_digest"] for x in swarm.status(source)["states_served"]]
    assert origin["anchor_digest"] in served  # the anchor the source held and attested

    # A node that crashes now restarts with its own command line, whose only initial peer is
    # the dead bootstrap: it rejoins, with its peer id, through the peers it remembered.
    crashed = nodes[1]
    crashed_id = swarm.status(crashed)["peer_id"]
    assert (swarm.workdir / "node-1" / "peers.json").exists()
    swarm.kill(crashed)
    crashed.proc.wait(timeout=30)
    again = swarm.join("node-1")
    swarm.serving(again)
    back = poll(
        lambda: (s := swarm.status(again)) and s["state"] == "active" and s,
        120,
        "the crashed node active again",
    )
    assert back["peer_id"] == crashed_id


def test_sigkill_drops_record_sigterm_leaves_cleanly_and_restart_resumes(swarm, tmp_path):
    swarm.bootstrap("tiny")
    nodes = [swarm.join(f"node-{i}") for i in range(4)]
    for node in nodes:
        swarm.serving(node)
    statuses = poll(lambda: _active(swarm, nodes), 120, "4 active nodes")
    ids = [s["peer_id"] for s in statuses]

    # SIGKILL: the record expires from every other node's view (ttl 6 s + refresh 1 s).
    victim, others = nodes[1], [nodes[0], nodes[2], nodes[3]]
    swarm.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()

    def declared_dead(node) -> bool:  # SWIM gossip, well before the record expires
        view = (swarm.status(node) or {}).get("members", {}).get("view", [])
        return any(m["peer_id"] == ids[1] and m["status"] == "dead" for m in view)

    for node in others:
        poll(lambda n=node: declared_dead(n), 20, "membership to declare the killed node dead")
    detected_after = time.monotonic() - killed_at
    print(f"SIGKILL -> declared dead by all survivors after {detected_after:.1f}s")
    for node in others:
        poll(
            lambda n=node: (
                ids[1] not in {p["peer_id"] for p in swarm.peers(n) or [{"peer_id": ids[1]}]}
            ),
            30,
            "dead record gone",
        )
    dropped_after = time.monotonic() - killed_at
    assert dropped_after < 6 + 1 + 5, dropped_after  # expiry + refresh + one DHT round trip

    # SIGTERM: exit 0, checkpoint written, record withdrawn at once (well before expiry).
    leaver = nodes[2]
    step_before = swarm.status(leaver)["inner_step"]
    swarm.kill(leaver, signal.SIGTERM)
    # while it drains and checkpoints, /readyz says so (it said "active" to the end before)
    ready = poll(lambda: _readiness(leaver.status_port), 30, "/readyz while leaving")
    assert ready == {"ready": False, "state": "leaving"}
    assert leaver.proc.wait(timeout=60) == 0
    log = swarm.log(leaver)
    assert "checkpoint saved" in log
    poll(
        lambda: (
            ids[2] not in {p["peer_id"] for p in swarm.peers(nodes[0]) or [{"peer_id": ids[2]}]}
        ),
        5,
        "withdrawn record",
    )

    # Restart with the same identity and data dir: same peer id, the checkpoint's weights.
    from agora_node.node.checkpoint import load_latest_checkpoint

    ckpt_dir = next((tmp_path / "node-2" / "checkpoints").glob("*/stage-*"))
    info, state = load_latest_checkpoint(
        ckpt_dir, run_id=statuses[2]["run_id"], stage=statuses[2]["stage"]
    )
    assert info.step >= step_before
    restarted = swarm.join("node-2", "--stage", str(statuses[2]["stage"]))
    swarm.serving(restarted)
    again = poll(
        lambda: (s := swarm.status(restarted)) and s["state"] == "active" and s,
        120,
        "restarted node active",
    )
    assert again["peer_id"] == ids[2]
    assert again["state_origin"]["kind"] == "checkpoint"
    assert again["state_origin"]["param_checksum"] == _checksum(state["model"])


def _readiness(port: int) -> dict | None:
    """/readyz's answer once it is not "active" (503 while leaving); None before."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
            return None  # 200: still active
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())
    except OSError:
        return None


def _checksum(model_state: dict) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model_state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_forged_records_are_ignored_by_every_node(swarm):
    import hivemind
    from hivemind.utils import get_dht_time

    from agora_node.protocol.identity import Identity
    from agora_node.protocol.names import stage_key
    from agora_node.protocol.records import NodeRecord

    swarm.bootstrap("tiny")
    nodes = [swarm.join(f"node-{i}", "--stage", str(i)) for i in range(2)]
    for node in nodes:
        swarm.serving(node)
    statuses = poll(lambda: _active(swarm, nodes), 120, "2 active nodes")
    run_id = statuses[0]["run_id"]

    victim, forger, stranger = statuses[0]["peer_id"], Identity.generate(), Identity.generate()
    # (a) a record claiming the victim's peer id, signed with another key;
    fake = NodeRecord(
        run_id=run_id, peer_id=forger.peer_id, stage=0, state="active", throughput=1e9
    )
    forged = {
        "r": fake.canonical_bytes().replace(forger.peer_id.encode(), victim.encode()),
        "s": fake.sign(forger)["s"],
    }
    # (b) a valid record altered after signing;
    honest = NodeRecord(
        run_id=run_id, peer_id=stranger.peer_id, stage=1, state="active", throughput=10.0
    )
    signed = honest.sign(stranger)
    altered = {
        "r": signed["r"].replace(b'"throughput":10.0', b'"throughput":9e9'),
        "s": signed["s"],
    }
    # (c) a correctly signed record for another run.
    other_run = NodeRecord(run_id="0" * 16, peer_id=forger.peer_id, stage=1, state="active").sign(
        forger
    )

    dht = hivemind.DHT(initial_peers=swarm.initial_peers, start=True)
    try:
        exp = get_dht_time() + 10  # within the records' lifetime: the DHTs store them
        # (a) and (b) are refused by the honest nodes' DHTs already (protocol/storable.py):
        # a subkey that is no peer's or run's id is refused, and a value under a peer's
        # subkey must carry that peer's signature (only this stranger's DHT keeps them,
        # and readers discard its whole answer for the key)
        dht.store(stage_key(run_id, 0), forged, exp, subkey=victim + "x")
        dht.store(stage_key(run_id, 1), altered, exp, subkey=stranger.peer_id)
        # (c) is refused by them too: it names another run's key, not the one it is under
        # (a signed value under a run's manifest key had blocked every joiner)
        assert not dht.store(stage_key(run_id, 1), other_run, exp, subkey=forger.peer_id)
        assert dht.store(  # the same record under its own run's key is stored
            stage_key("0" * 16, 1), other_run, exp, subkey=forger.peer_id
        )
        honest = {s["peer_id"] for s in statuses}

        def only_honest_seen() -> bool:  # a view read after the stores, of both nodes
            return all({p["peer_id"] for p in swarm.peers(n)} == honest for n in nodes)

        poll(only_honest_seen, 30, "every node's view: the honest nodes and no one else")
        for node in nodes:
            rejected = (swarm.status(node) or {}).get("records_rejected", {})
            assert rejected.get("signature", 0) == 0, rejected  # (a), (b) never reached one
    finally:
        dht.shutdown()


def _cli(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agora_node", *argv], capture_output=True, text=True, timeout=timeout
    )


def _one_clear_line(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode != 0
    errors = [
        line for line in (result.stdout + result.stderr).splitlines() if "error" in line.lower()
    ]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-2000:]
    assert len(errors) == 1 and needle in errors[0], result.stdout[-1000:] + result.stderr[-1000:]


def test_bad_cli_input_is_one_clear_line(swarm, tmp_path):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"
    swarm.bootstrap("tiny")
    base = ["join", "--initial-peers", *swarm.initial_peers, "--status-port", "0"]
    other = small_manifest(tmp_path / "other.toml", stages=2, layers=8)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        cases = [  # (argv, what the one error line says); each in a data dir of its own
            (["join", "--initial-peers", dead, "--status-port", "0"], "could not reach"),
            ([*base, "--stage", "9"], "--stage 9 does not exist"),
            ([*base[:-1], port], "in use"),
            ([*base, "--manifest", other], "does not serve your manifest"),
            ([*base, "--stage", "two"], "--stage must be"),
        ]
        # independent processes: run them side by side (each spends seconds importing)
        with ThreadPoolExecutor(len(cases)) as pool:
            results = list(
                pool.map(
                    lambda i: _cli(*cases[i][0], "--data-dir", str(tmp_path / f"d{i}")),
                    range(len(cases)),
                )
            )
    for (_, needle), result in zip(cases, results, strict=True):
        _one_clear_line(result, needle)


@pytest.mark.slow  # 26 s; the default suite has dry runs in tests/surfaces/test_daemon_options.py, the
# status table in tests/surfaces/test_status_cli.py and the control API in test_control.py
def test_dry_run_status_table_and_leave_through_the_control_api(swarm, tmp_path):
    swarm.bootstrap("tiny")
    dry = _cli(
        "join",
        "--initial-peers",
        *swarm.initial_peers,
        "--data-dir",
        str(tmp_path / "dry"),
        "--dry-run",
    )
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "would serve stage" in dry.stdout and "total_bytes" in dry.stdout
    assert "peer id: 12D3KooW" in dry.stdout  # what a private swarm's --allow-keys lists

    node = swarm.join("node", "--stage", "2")
    port = swarm.serving(node)
    poll(lambda: (s := swarm.status(node)) and s["state"] == "active", 120, "active")
    table = _cli("status", "--url", f"http://127.0.0.1:{port}")
    assert table.returncode == 0 and "active" in table.stdout, table.stdout + table.stderr

    left = _cli("leave", "--data-dir", str(tmp_path / "node"))
    assert left.returncode == 0, left.stdout + left.stderr
    assert node.proc.wait(timeout=10) == 0  # `leave` returned once the daemon had exited
    assert "checkpoint saved" in swarm.log(node)


def test_daemons_with_own_identities_get_own_data_dirs_and_a_clash_fails_at_once(
    swarm, tmp_path, monkeypatch
):
    """The reported defect: daemons given only --identity-path shared ~/.agora-node and
    all but one died ~9 s later on the control socket. Now each gets its own data dir,
    and a daemon started on a data dir in use fails at once, naming the holder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the children's ~
    swarm.bootstrap("tiny")
    peers = swarm.initial_peers
    nodes = [
        swarm.spawn(
            name,
            ["join", "--initial-peers", *peers, "--identity-path", str(tmp_path / f"{name}.key")]
            + ["--status-port", "0", *FAST],
        )
        for name in ("a", "b")
    ]
    for node in nodes:
        swarm.serving(node)
    poll(lambda: _active(swarm, nodes), 120, "both nodes active (control sockets up)")
    dirs = tmp_path / "home" / ".agora-node" / "nodes"
    for node in nodes:
        assert (dirs / node.name / "lock").read_text() == f"{node.proc.pid}\n"
        assert (dirs / node.name / "control.sock").is_socket()

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    clash = _cli("join", "--initial-peers", *peers, "--data-dir", str(dirs / "a"), timeout=30)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    assert clash.returncode == 1
    _one_clear_line(clash, f"pid {nodes[0].proc.pid}")
    assert "--data-dir" in clash.stderr
    # CPU time (two daemons train on these cores): it stops before any real work.
    assert cpu < 1.0, cpu
    assert all(node.proc.poll() is None for node in nodes)

    # a copy of a's key (a restored backup, a second machine) in a data dir of its own: the
    # key file is another file, so only the swarm can tell; it refuses before announcing
    copy = tmp_path / "copy" / "identity.key"
    copy.parent.mkdir()
    copy.write_bytes((tmp_path / "a.key").read_bytes())
    twin = _cli(
        "join", "--initial-peers", *peers, "--data-dir", str(copy.parent), "--status-port", "0",
        timeout=90,
    )  # fmt: skip
    _one_clear_line(twin, "another daemon serves stage")
    assert "with this identity key" in twin.stderr and twin.returncode == 1
    assert all(node.proc.poll() is None for node in nodes)
    assert swarm.status(nodes[0])["state"] == "active"


@pytest.mark.slow  # 45-65 s; the switch decision is tests/policy/test_should_switch.py
def test_auto_node_moves_to_a_stage_that_lost_its_last_replica(swarm):
    swarm.bootstrap("tiny")
    fixed = [swarm.join(f"fixed-{s}", "--stage", str(s)) for s in (1, 2, 3)]
    auto = [swarm.join(f"auto-{i}", "--rebalance-every", "4") for i in range(3)]
    nodes = fixed + auto
    for node in nodes:
        swarm.serving(node)
    # Nodes may rebalance meanwhile; kill a fixed node that is its stage's only replica now.
    statuses = poll(lambda: _active(swarm, nodes), 120, "6 active nodes")
    stages = [s["stage"] for s in statuses]
    victim_index = next(i for i, s in enumerate(stages[:3]) if stages.count(s) == 1)
    victim, lost = fixed[victim_index], stages[victim_index]
    swarm.kill(victim)

    def someone_serves_lost_stage():
        return any(
            (s := swarm.status(n)) and s["stage"] == lost and s["state"] == "active" for n in auto
        )

    poll(someone_serves_lost_stage, 90, f"an auto node to take over stage {lost}")
    mover = next(n for n in auto if swarm.status(n)["stage"] == lost)
    assert "switching from stage" in swarm.log(mover)
    head = next(n for n in nodes if n is not victim and (swarm.status(n) or {}).get("stage") == 0)
    ok = swarm.status(head)["microbatches"].get("ok", 0)
    poll(
        lambda: swarm.status(head)["microbatches"].get("ok", 0) >= ok + 5, 90, "training to resume"
    )


@pytest.mark.slow  # 35-40 s
def test_joiner_retries_another_replica_when_its_source_dies_mid_transfer(swarm):
    # `bench` stage 0 state is ~47 MiB (weights + AdamW moments).
    swarm.bootstrap("bench")
    # Sources send through an emulated 40 Mbit/s uplink: ~10 s per copy, so the
    # kill lands mid-transfer however fast the machine is.
    sources = [
        swarm.join(f"source-{i}", "--stage", "0", "--emulate-link", "40,0") for i in range(2)
    ]
    for node in sources:
        swarm.serving(node, timeout=180)
    ids = [s["peer_id"] for s in poll(lambda: _active(swarm, sources), 180, "2 active sources")]
    joiner = swarm.join("joiner", "--stage", "0")

    def receiving_from() -> str | None:
        for line in swarm.log(joiner).splitlines():
            if "state of stage 0 from" in line:
                return line.split("from ", 1)[1].split(":", 1)[0]
        return None

    first = poll(receiving_from, 180, "the joiner to start receiving state")
    victim = next(n for n, pid in zip(sources, ids, strict=True) if pid.endswith(first))
    swarm.kill(victim)
    swarm.serving(joiner, timeout=180)
    status = poll(
        lambda: (s := swarm.status(joiner)) and s["state"] == "active" and s, 180, "joiner active"
    )
    origin = status["state_origin"]
    assert origin["kind"] == "replica" and not origin["source"].endswith(first), origin
    assert origin["attested_by"] == 2 and first in "".join(origin["unavailable"]), origin
    assert "trying another replica" in swarm.log(joiner)
