"""What the status page shows, decided without a network: membership events, anchor
agreement, what a stage waits on, peers flagged in outer rounds, round summaries."""

from types import SimpleNamespace

from agora_node.comms.membership.members import MemberView
from agora_node.comms.membership.messages import MemberMeta, Status
from agora_node.node.liveness import MAX_LAST, RECENT_EVENTS, Liveness, membership_event
from agora_node.node.round_report import round_summary
from agora_node.node.rounds import anchor_agreement
from agora_node.node.snapshot import flags_by_peer, node_waiting_on, waiting_on


def view(status: Status, stage: int = 1, peer: str = "B") -> MemberView:
    return MemberView(peer, status, 0, MemberMeta(stage=stage, state="active"), 0.0)


def test_membership_events_name_each_status_change_once():
    assert membership_event(None, view(Status.ALIVE)) == "joined"
    assert membership_event(Status.ALIVE, view(Status.SUSPECT)) == "suspected"
    assert membership_event(Status.SUSPECT, view(Status.ALIVE)) == "alive"
    assert membership_event(Status.SUSPECT, view(Status.DEAD)) == "dead"
    assert membership_event(Status.ALIVE, view(Status.LEFT)) == "left"
    assert membership_event(Status.ALIVE, view(Status.ALIVE)) is None


def test_liveness_keeps_recent_events_with_times_and_stage_moves():
    now = iter(range(1000))
    live = Liveness(clock=lambda: float(next(now)))
    live.note(view(Status.ALIVE, stage=-1))  # joining: no stage yet
    live.note(view(Status.ALIVE, stage=2))  # chose stage 2: not a move
    live.note(view(Status.ALIVE, stage=3))  # moved
    live.note(view(Status.SUSPECT, stage=3))
    live.note(view(Status.DEAD, stage=3))
    assert [(e["at"], e["event"], e["stage"]) for e in live.events] == [
        (0.0, "joined", -1),
        (1.0, "moved", 3),
        (2.0, "suspected", 3),
        (3.0, "dead", 3),
    ]
    for i in range(2 * RECENT_EVENTS):
        live.note(view(Status.ALIVE, peer=f"P{i}"))
    assert (
        len(live.events) == RECENT_EVENTS
        and live.events[-1]["peer_id"] == f"P{2 * RECENT_EVENTS - 1}"
    )


def test_liveness_remembers_a_bounded_number_of_members():
    """Self-signed records of fresh keys each reached `note`; its table never shrank."""
    live = Liveness()
    live.note(view(Status.ALIVE, peer="B"))
    for i in range(MAX_LAST + 10):
        live.note(view(Status.ALIVE, peer=f"P{i}"))
        if i == MAX_LAST // 2:
            live.note(view(Status.SUSPECT, peer="B"))  # a member heard from again is kept
    assert len(live._last) == MAX_LAST and "B" in live._last and "P0" not in live._last


def test_liveness_tells_its_listeners_of_each_death_and_leave_once():
    live = Liveness()
    gone: list[str] = []
    live.on_gone.append(gone.append)
    for status, peer in [
        (Status.ALIVE, "B"),
        (Status.SUSPECT, "B"),
        (Status.DEAD, "B"),
        (Status.DEAD, "B"),  # the same news again: not a change
        (Status.ALIVE, "C"),
        (Status.LEFT, "C"),
    ]:
        live.note(view(status, peer=peer))
    assert gone == ["B", "C"]


def test_liveness_names_at_most_limit_alive_members_the_directory_lacks():
    """What the DHT is asked to meet after a healed partition (Node._meet_loop)."""

    class Swim:
        def alive_members(self) -> list[MemberView]:  # SWIM's alive and suspected
            return [view(Status.ALIVE, peer=p) for p in ("A", "B", "C", "D", "E")]

    live = Liveness()
    assert live.unlisted(set(), 8) == []  # before SWIM starts
    live.service = Swim()
    assert sorted(live.unlisted({"A", "C"}, 8)) == ["B", "D", "E"]
    two = live.unlisted({"A"}, 2)
    assert len(two) == 2 and set(two) <= {"B", "C", "D", "E"}
    assert live.unlisted({"A", "B", "C", "D", "E"}, 8) == []


def test_liveness_counts_as_answered_only_live_members_it_measured_a_round_trip_to():
    """What the peer book puts first (PeerBook.update): a dead member keeps its round
    trips for a while, a member never probed has none."""
    members = {
        "alive": view(Status.ALIVE, peer="alive"),
        "suspect": view(Status.SUSPECT, peer="suspect"),
        "dead": view(Status.DEAD, peer="dead"),
        "unprobed": view(Status.ALIVE, peer="unprobed"),
    }

    class Swim:
        def rtt(self, peer_id: str) -> float | None:
            return None if peer_id in ("unprobed", "stranger") else 0.01

        def get(self, peer_id: str) -> MemberView | None:
            return members.get(peer_id)

    live = Liveness()
    assert not live.answered("alive")  # before SWIM starts
    live.service = Swim()
    answered = [p for p in (*members, "stranger") if live.answered(p)]
    assert answered == ["alive", "suspect"]


def test_anchor_agreement_per_kept_round():
    own = {4: "aa", 5: "bb"}
    others = {5: {"X": "bb", "Y": "cc"}, 9: {"X": "zz"}}
    assert anchor_agreement(own, others) == {
        "4": {"agree": [], "differ": []},
        "5": {"agree": ["X"], "differ": ["Y"]},
    }


def test_waiting_on_names_the_empty_neighbour_stage():
    assert waiting_on(0, 3, {1: 2}) is None
    assert waiting_on(0, 3, {1: 0}) == "stage 1 (no replica downstream)"
    assert waiting_on(2, 3, {1: 0}) == "stage 1 (no replica upstream)"
    assert waiting_on(1, 3, {0: 0, 2: 0}) == (
        "stage 0 (no replica upstream), stage 2 (no replica downstream)"
    )
    assert waiting_on(0, 1, {}) is None  # a one-stage run needs nobody


def test_waiting_on_names_a_next_stage_that_refuses_every_micro_batch():
    """A node whose micro-batches the next stage refused one and all showed active, ready
    and waiting on nothing (its only trace: dropped and hop failures going up)."""
    import time

    pipeline = SimpleNamespace(refused_by=None, last_request_at=time.monotonic())
    node = SimpleNamespace(
        service=SimpleNamespace(index=0, pipeline=pipeline),
        manifest=SimpleNamespace(num_stages=2),
        _peers_of=lambda stage: ["someone"],
    )
    assert node_waiting_on(node) is None
    pipeline.refused_by = (time.monotonic(), 1, "activation norm far from the recent ones")
    assert node_waiting_on(node) == (
        "stage 1 (refuses our micro-batches: 'activation norm far from the recent ones')"
    )
    pipeline.refused_by = (time.monotonic() - 120, 1, "old news")
    assert node_waiting_on(node) is None


def test_waiting_on_says_when_upstream_sent_nothing_for_long():
    """A QA run's honest replica, banned by the only head, showed active and waiting on
    nothing while it sat idle for ten minutes."""
    import time

    pipeline = SimpleNamespace(refused_by=None, last_request_at=time.monotonic())
    node = SimpleNamespace(
        service=SimpleNamespace(index=1, pipeline=pipeline),
        manifest=SimpleNamespace(num_stages=2),
        _peers_of=lambda stage: ["a head"],
    )
    assert node_waiting_on(node) is None
    pipeline.last_request_at -= 120
    assert node_waiting_on(node).startswith("stage 0 (sent this node nothing for 12")
    node.service.index = 0  # a head injects its own: nobody upstream to wait for
    assert node_waiting_on(node) is None


def report(**fields) -> SimpleNamespace:
    base = dict(
        round=7,
        participants=3,
        delta_group=("A", "B"),
        anchor_mixed=True,
        consistent=False,
        bytes_sent=10,
        bytes_received=12,
        seconds_blocked=0.5,
        failed_peers=["C"],
        outliers=["B"],
        bounded=[],
        direction_outliers=[],
        replayed=[],
        mismatched=[],
        equivocated=[],
    )
    return SimpleNamespace(**(base | fields))


def test_round_summaries_and_the_peers_they_flag():
    first = round_summary(report(), at=100.0)
    assert first == {
        "round": 7,
        "at": 100.0,
        "participants": 3,
        "group": ["A", "B"],
        "anchor_mixed": True,
        "consistent": False,
        "bytes_sent": 10,
        "bytes_received": 12,
        "seconds_blocked": 0.5,
        "failed_peers": ["C"],
        "outliers": ["B"],
        "direction_outliers": [],
        "replayed": [],
        "mismatched": [],
        "equivocated": [],
        "bounded": [],
    }
    second = round_summary(
        report(
            round=8,
            failed_peers=[],
            mismatched=["B"],
            direction_outliers=["D"],
            replayed=["E"],
            equivocated=["F"],
        ),
        at=110.0,
    )
    assert flags_by_peer([first, second]) == {
        "C": {"failed": 1},
        "B": {"outlier": 2, "mismatched": 1},
        "D": {"direction_outlier": 1},
        "E": {"replayed": 1},
        "F": {"equivocated": 1},
    }
