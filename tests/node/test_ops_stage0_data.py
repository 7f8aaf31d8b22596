"""Stage 0 reads the run's corpus; a node without it must not end up there.

A `--stage auto` node without the run's data serves (and moves among) the other
stages only, saying why in one INFO line; `--stage 0` without it stops as it joins
with one line (JoinError, exit 1); and stage 0's head builds its token windows off
the event loop (reading and tokenizing a corpus takes seconds on a large one).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

import pytest

from agora_node.node import service as service_module
from agora_node.node.config import NodeConfig
from agora_node.node.daemon import Node
from agora_node.node.errors import JoinError
from agora_node.node.service import StageService
from agora_node.protocol.manifest import parse_manifest
from agora_node.stages import placement
from agora_node.stages.data import head_data_missing
from agora_node.stages.device import CPU
from agora_node.stages.manifest_files import builtin_manifest_text

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJTjvve5CHTecvRiyBZSEgRN7cHWUDhThRpcBxcUEb3xX"
BUILTIN = 'source = "builtin:tinyshakespeare"'


def manifest(source: str | None = None, stages: int = 4):  # noqa: ANN201
    text = builtin_manifest_text("tiny").replace("count = 4", f"count = {stages}")
    if source is not None:
        text = text.replace(BUILTIN, f"source = {source!r}")
    return parse_manifest(text)


def peer_placed_at_stage_0(m) -> str:  # noqa: ANN001
    """A peer id that an empty swarm would place at stage 0 (ties go by peer id hash)."""
    for i in range(1000):
        peer = f"12D3KooWpeer{i}"
        if placement.choose_stage({}, m, peer).stage == 0:
            return peer
    raise AssertionError("no peer id lands on stage 0")


class FakeDirectory:
    async def fetch(self) -> dict:
        return {}


def joining_node(tmp_path, m, stage: str = "auto", local: bool = True) -> tuple[Node, list[int]]:  # noqa: ANN001
    """A Node as it is when it chooses its stage (the swarm: an empty directory); `local`:
    its operator gave the run's manifest (--manifest), else it came from the swarm."""
    node = Node.__new__(Node)
    node.config = NodeConfig(
        manifest="tiny" if local else None,
        initial_peers=[PEER],
        data_dir=str(tmp_path),
        stage=stage,
        settle_s=0.0,
        settle_rounds=1,
    )
    node.manifest, node.compute, node.directory = m, CPU, FakeDirectory()
    node.peer_id = peer_placed_at_stage_0(m)
    node.can_hold, node.stage = None, None
    announced: list[int] = []

    async def announce(stage: int) -> None:
        announced.append(stage)

    node._announce_joining = announce
    return node, announced


async def test_an_auto_node_without_the_data_never_takes_stage_0(tmp_path, caplog):
    m = manifest(str(tmp_path / "missing.txt"))
    node, announced = joining_node(tmp_path, m)
    with caplog.at_level(logging.INFO, logger="agora_node.node.daemon"):
        stage = await node._choose_stage()
    assert stage != 0 and 0 not in announced
    assert node.can_hold == [1, 2, 3]  # what rebalancing moves among, too
    lines = [r.getMessage() for r in caplog.records if "not serving stage 0" in r.getMessage()]
    assert len(lines) == 1 and "data.source" in lines[0] and "missing.txt" in lines[0], lines


async def test_an_auto_node_with_the_data_may_take_stage_0(tmp_path, caplog):
    node, _ = joining_node(tmp_path, manifest())
    with caplog.at_level(logging.INFO, logger="agora_node.node.daemon"):
        assert await node._choose_stage() == 0
    assert node.can_hold is None
    assert "not serving stage 0" not in caplog.text


async def test_stage_0_asked_for_without_the_data_is_refused_in_one_line(tmp_path):
    m = manifest(str(tmp_path / "missing.txt"))
    node, announced = joining_node(tmp_path, m, stage="0")
    with pytest.raises(JoinError) as info:
        await node._choose_stage()
    text = str(info.value)
    assert text.startswith("--stage 0: stage 0 reads the run's data") and "\n" not in text
    assert "missing.txt" in text and "another --stage" in text
    assert announced == []  # refused before it announced itself anywhere
    other, _ = joining_node(tmp_path, m, stage="2")
    assert await other._choose_stage() == 2  # other stages need no data


async def test_a_one_stage_run_without_the_data_leaves_nothing_to_serve(tmp_path):
    node, _ = joining_node(tmp_path, manifest(str(tmp_path / "missing.txt"), stages=1))
    with pytest.raises(JoinError, match="can serve no stage: .*no other stage"):
        await node._choose_stage()


def test_what_stage_0_needs(tmp_path, monkeypatch):
    assert head_data_missing(manifest()) is None
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello")
    assert head_data_missing(manifest(str(corpus))) is None
    assert "file not found" in head_data_missing(manifest(str(tmp_path / "nope.txt")))
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text("{}")
    m = parse_manifest(
        builtin_manifest_text("tiny").replace(
            'tokenizer = "bytes"', f"tokenizer = {str(tokenizer)!r}"
        )
    )
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert "needs the 'tokenizers' package" in head_data_missing(m)


async def test_the_head_builds_its_token_windows_off_the_event_loop(monkeypatch):
    """Tokenizing a corpus on the loop stalled SWIM, the directory and the status page."""
    loop_thread = threading.current_thread()
    built_on: list[threading.Thread] = []

    class Windows:
        def __init__(self, manifest, split) -> None:  # noqa: ANN001
            built_on.append(threading.current_thread())
            raise RuntimeError("enough")  # stops the head loop here

    monkeypatch.setattr(service_module, "TokenWindows", Windows)
    fake = SimpleNamespace(ctx=SimpleNamespace(manifest=manifest(), config=None))
    with pytest.raises(RuntimeError, match="enough"):
        await asyncio.wait_for(StageService._head_loop(fake), 30)
    assert built_on and loop_thread not in built_on


async def test_an_auto_node_whose_manifest_came_from_the_swarm_reads_no_local_file(tmp_path):
    """A stranger's manifest naming a file on this machine as data.source (say
    /proc/self/environ): the head tokenized it and sent it on as token ids."""
    data = tmp_path / "corpus.txt"
    data.write_text("some text " * 200)
    node, announced = joining_node(tmp_path, manifest(str(data)), local=False)
    stage = await node._choose_stage()
    assert stage != 0 and 0 not in announced
    node, _ = joining_node(tmp_path, manifest(str(data)), stage="0", local=False)
    with pytest.raises(JoinError, match="named by the swarm's manifest"):
        await node._choose_stage()
