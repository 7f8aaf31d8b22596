"""Run the dashboard's script under node with a stub DOM (skipped when node is absent).

Checks what a browser would render from real endpoint JSON, and that strings
from strangers (peer ids, states) arrive escaped.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import aiohttp
import pytest

from .conftest import FakeDaemon

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
]

HOSTILE = '<img src=x onerror="alert(1)">'

# A minimal DOM: elements by id, fetch answering from the JSON the server gave,
# and setTimeout (called once a poll is done) dumping what was rendered.
HARNESS = """
const elements = {};
globalThis.document = { getElementById: (id) =>
  (elements[id] ??= { textContent: "", innerHTML: "", className: "", style: {} }) };
const answers = %s;
globalThis.fetch = async (path) => ({ ok: true, status: 200, json: async () => answers[path] });
globalThis.setTimeout = () => { console.log(JSON.stringify(elements)); };
"""


async def fetch_page_and_data(url: str) -> tuple[str, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/") as r:
            html = await r.text()
        data = {}
        for path in ("api/v1/status", "api/v1/peers"):
            async with session.get(f"{url}/{path}") as r:
                data[path] = await r.json()
    return html, data


async def test_dashboard_renders_and_escapes(status_server, daemon: FakeDaemon, tmp_path: Path):
    daemon.current["stages"][0]["peers"][0].update(peer_id=HOSTILE, state="<b>bad</b>")
    daemon.current["node"]["members"]["events"][0].update(peer_id=HOSTILE, event="<b>x</b>")
    html, data = await fetch_page_and_data(status_server.url)
    script = re.search(r"<script nonce=\"[^\"]+\">(.*)</script>", html, re.S).group(1)
    harness = tmp_path / "dashboard.js"
    harness.write_text(HARNESS % json.dumps(data) + script)
    proc = await asyncio.create_subprocess_exec(
        "node", str(harness), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, err.decode()
    dom = json.loads(out)

    assert dom["banner"]["style"] == {"display": "none"}  # both fetches succeeded
    assert dom["state"]["textContent"] == "active"
    assert "1 / 3" in dom["node"]["innerHTML"] and "3.812" in dom["node"]["innerHTML"]
    assert "via Zz99Yy88 · 1 peer(s) relayed" in dom["node"]["innerHTML"]
    assert "leader of AAAAAAAA, BBBBBBBB · K/V 49.2 B/token" in dom["node"]["innerHTML"]
    swarm = dom["map"]["innerHTML"]
    assert swarm.count('class="stage"') == 3 and "(this node)" in swarm and "no peer" in swarm
    assert "<img" not in swarm and "<b>" not in swarm
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in swarm
    assert swarm.count("<polyline") == 0 and dom["plots"]["innerHTML"].count("<polyline") == 2
    assert "swim alive" in swarm and "util 42 %" in swarm
    assert "rtt 42.5 ms" in swarm and swarm.count("rtt ") == swarm.count("swim alive")

    rounds = dom["rounds"]["innerHTML"]
    assert rounds.count("data-round=") == 2 and "results agree" in rounds
    assert "anchor same as 1/1 replica(s)" in rounds and "mixed" in rounds
    events, stages = dom["events"]["innerHTML"], dom["stages"]["innerHTML"]
    assert "ev-left" in events and "<b>" not in events and "&lt;b&gt;x&lt;/b&gt;" in events
    assert "chose 1" in stages and "least capacity" in stages
    assert "65,536" in dom["contrib"]["innerHTML"]
    assert dom["waiting"]["textContent"] == "waiting on stage 2 (no replica downstream)"
    assert dom["waiting"]["style"] == {"display": "block"}
