"""The dashboard in a real browser (headless Chromium), from a fake daemon's snapshot:
the CSP lets its script run, every section renders, strangers' strings stay text.
The same page on a live swarm: tests/integration/test_metrics_swarm.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.chromium import dump_dom, need_chromium

from .conftest import OTHER_ID, FakeDaemon

pytestmark = pytest.mark.timeout(90)

HOSTILE = '<img src=x onerror="document.title=1">'


async def test_dashboard_renders_in_chromium(status_server, daemon: FakeDaemon, tmp_path: Path):
    browser = need_chromium()
    daemon.current["stages"][0]["peers"][0].update(peer_id=HOSTILE)
    daemon.current["stages"][1]["peers"][1].update(flags={"outlier": 2}, anchor_agrees=False)
    dom = await asyncio.to_thread(dump_dom, browser, status_server.url + "/", tmp_path)

    assert 'id="state" class="badge s-active">active<' in dom  # the script ran under the CSP
    assert dom.count('class="stage"') == 3 and "(this node)" in dom
    assert "&lt;img src=x" in dom and "<img" not in dom
    assert "outlier ×2" in dom and "anchor differs" in dom and "util 42 %" in dom
    assert dom.count("data-round=") == 2 and "results agree" in dom
    assert 'class="ev-joined"' in dom and 'class="ev-left"' in dom
    assert f'title="{OTHER_ID}"' in dom  # contribution and rounds name peers in full on hover
    assert "waiting on stage 2 (no replica downstream)" in dom
    assert "compute 40% · downstream 50% · upstream 10% (outer rounds blocked 3%)" in dom
    assert "NO: 1 peer(s) could not dial /ip4/192.168.1.20/tcp/31337" in dom
    assert dom.count("<polyline") == 2
