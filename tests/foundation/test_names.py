"""DHT keys and libp2p names: exact spellings (they are the wire), distinct, defined once."""

import re
from pathlib import Path

import pytest

from agora_node.protocol import names

pytestmark = pytest.mark.timeout(60)

RUN = "r1"


def all_names(run_id: str) -> dict[str, str]:
    return {
        "stage_key": names.stage_key(run_id, 2),
        "manifest_key": names.manifest_key(run_id),
        "run_pointer_key": names.run_pointer_key(),
        "outer_round_key": names.outer_round_key(run_id, 2, 7),
        "outer_namespace": names.outer_namespace(run_id, 2),
        "swim_namespace": names.swim_namespace(run_id),
        "standalone_swim_namespace": names.STANDALONE_SWIM_NAMESPACE,
        "forward_protocol": names.forward_protocol(run_id),
        "state_protocol": names.state_protocol(run_id),
        "cell_protocol": names.cell_protocol(run_id),
        "cell_work_protocol": names.cell_work_protocol(run_id),
        "reachability_protocol": names.reachability_protocol(run_id),
        "relay_protocol": names.relay_protocol(run_id),
        "outer_stream_protocol": names.outer_stream_protocol(names.outer_namespace(run_id, 2)),
        "relayed_protocol": names.relayed_protocol(run_id),
    }


def test_exact_spellings_are_pinned():
    # Changing any of these breaks compatibility with every deployed peer: do it deliberately.
    assert all_names(RUN) == {
        "stage_key": "agora/r1/stage/2",
        "manifest_key": "agora/r1/manifest",
        "run_pointer_key": "agora/current-run",
        "outer_round_key": "agora/r1/outer-v2/2/7",  # v2: signed parts
        "outer_namespace": "agora/r1/outer-v2/2",
        "swim_namespace": "agora/r1/swim",
        "standalone_swim_namespace": "agora-membership",
        "forward_protocol": "/agora/r1/forward/1",
        "state_protocol": "/agora/r1/state/2",  # 2: attested anchor state (docs/security.md)
        "cell_protocol": "/agora/r1/cell/1",
        "cell_work_protocol": "/agora/r1/cellwork/1",
        "reachability_protocol": "/agora/r1/reachability/1",
        "relay_protocol": "/agora/r1/relay/1",
        "outer_stream_protocol": "/agora/r1/outer-v2/2/stream/1",
        "relayed_protocol": "/agora/r1/relayed/1",
    }


def test_names_are_distinct_and_run_scoped():
    ours, theirs = all_names(RUN), all_names("r2")
    assert len(set(ours.values())) == len(ours)
    shared = {"run_pointer_key", "standalone_swim_namespace"}  # deliberately run-independent
    for name in ours.keys() - shared:
        assert ours[name] != theirs[name], name
    assert names.stage_key(RUN, 0) != names.stage_key(RUN, 1)
    assert names.outer_round_key(RUN, 0, 1) != names.outer_round_key(RUN, 1, 0)


# daemon.py still spells the SWIM namespace itself; it moves to names.swim_namespace after
# the daemon split lands (then drop it from here).
def test_no_module_spells_a_name_itself():
    package = Path(names.__file__).resolve().parents[1]
    literal = re.compile(r"""f?["']/?agora/""")
    offenders = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if path != Path(names.__file__).resolve() and literal.search(path.read_text())
    ]
    assert offenders == [], (
        f"build DHT keys and protocol names with agora_node.protocol.names: {offenders}"
    )
