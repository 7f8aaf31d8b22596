"""deploy/: the Grafana dashboard queries real series; the compose file, the systemd
unit and the Dockerfile run commands the CLI accepts; the unit passes systemd-analyze."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from agora_node.node.cli import build_parser
from agora_node.node.metrics import Metrics

from .conftest import make_snapshot

pytestmark = pytest.mark.timeout(60)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PEER_ID = "12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"


def live_series() -> set[str]:
    """Every sample name a daemon's /metrics can show, with each labelled series present."""
    m = Metrics()
    m.count_microbatch("rejected", latency_s=0.1, code="bad_frame")
    m.count_rejected_record("bad_signature")
    m.count_refused("forward", "rate")
    m.count_injected(64)
    m.count_completed(64)
    m.add_bytes("peer", sent=1, received=1)
    snapshot = make_snapshot()
    members = snapshot["node"].setdefault("members", {})
    members.setdefault("counters", {})["suspected"] = 1  # a SWIM event: agora_membership_events
    m.update_from_snapshot(snapshot)
    text = m.render().decode()
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line[:1] not in "#"}


def test_every_grafana_query_names_a_series_that_exists():
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert len(dashboard["panels"]) >= 10
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    series = live_series()
    for expr in exprs:
        names = set(re.findall(r"\bagora_[a-z_]+", expr))
        assert names, expr
        assert names <= series, f"{expr}: no series {sorted(names - series)}"


def _accepted(argv: list[str]) -> None:
    build_parser().parse_args(argv)  # exits (SystemExit) on an unknown flag


def test_compose_file_has_the_keys_and_commands_the_cli_accepts():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert set(compose) == {"services", "volumes"}
    services = compose["services"]
    assert set(services) == {"bootstrap", "node"}
    for name, service in services.items():
        assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}, name
        assert (DEPLOY / ".." / service["build"]["dockerfile"]).is_file()
        assert service["stop_grace_period"] == "2m" and service["init"] is True
        command = [re.sub(r"\$\{BOOTSTRAP_PEER_ID[^}]*\}", PEER_ID, a) for a in service["command"]]
        _accepted(command)
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], volume
    assert services["node"]["depends_on"] == ["bootstrap"]


def test_unit_and_image_run_commands_the_cli_accepts():
    unit = (DEPLOY / "agora-node.service").read_text()
    exec_start = re.search(r"^ExecStart=(\S+) (.*)$", unit, re.M)
    assert exec_start and exec_start.group(1).endswith("/agora-node")
    _accepted([*shlex.split(exec_start.group(2)), "--initial-peers", f"/p2p/{PEER_ID}"])
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    _accepted(cmd)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_unit_verifies(tmp_path):
    """systemd-analyze verify in a scratch root that has the binary and the env file."""
    units = Path("/usr/lib/systemd/system")
    if not (units / "sysinit.target").exists():
        pytest.skip("no systemd unit library to verify against")
    shutil.copytree(units, tmp_path / "usr/lib/systemd/system", symlinks=True)
    binary = tmp_path / "usr/local/bin/agora-node"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (tmp_path / "etc/default").mkdir(parents=True)
    (tmp_path / "etc/default/agora-node").write_text(f"AGORA_INITIAL_PEERS=/p2p/{PEER_ID}\n")
    target = tmp_path / "etc/systemd/system/agora-node.service"
    target.parent.mkdir(parents=True)
    shutil.copy(DEPLOY / "agora-node.service", target)
    result = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            f"--root={tmp_path}",
            "/etc/systemd/system/agora-node.service",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
