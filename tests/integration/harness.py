"""Real daemons on 127.0.0.1 for integration tests: start, watch, kill by pid.

Each daemon is `python -m agora_node ...` in its own session. Its DHT process and
libp2p daemon run in sessions of their own (comms/host.py), so killing its process
group kills the daemon alone, and its reaper (comms/reaper.py) then stops them and
removes their sockets. Nothing here sleeps to hope: every wait polls a condition
under a deadline.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agora_node.node.demo import Child, Swarm, fetch_status, wait_for_line

T = TypeVar("T")

FAST = [
    "--record-ttl",
    "6",
    "--refresh",
    "1",
    "--eval-every",
    "10000",
    "--checkpoint-every",
    "10000",
    "--threads",
    "1",
]
_PORT = re.compile(r"status page http://127\.0\.0\.1:(\d+)/")


def poll(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Return condition()'s first truthy value; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T = None  # type: ignore[assignment]
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)  # polling interval of a deadline-bounded wait, not a hope-sleep
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


class TestSwarm(Swarm):
    __test__ = False  # not a pytest class

    def bootstrap(self, manifest: str = "tiny", *extra: str, prefix: tuple[str, ...] = ()) -> Child:
        boot = self.spawn(
            "bootstrap",
            [
                "bootstrap",
                "--manifest",
                manifest,
                "--data-dir",
                str(self.workdir / "bootstrap"),
                *extra,
            ],
            prefix=prefix,
        )
        line = wait_for_line(boot, "agora-node join --initial-peers", 60)
        self.initial_peers = line.split("--initial-peers", 1)[1].split()
        return boot

    def join(
        self,
        name: str,
        *extra: str,
        initial_peers: list[str] | None = None,
        data_dir: Path | None = None,
        module: str = "agora_node",
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> Child:
        peers = initial_peers or self.initial_peers
        argv = [
            "join",
            "--initial-peers",
            *peers,
            "--data-dir",
            str(data_dir or self.workdir / name),
        ]
        argv += ["--status-port", "0", *FAST, *extra]
        return self.spawn(name, argv, module=module, env=env, prefix=prefix)

    def serving(self, child: Child, timeout: float = 90) -> int:
        """Wait until the daemon serves; its status port."""
        line = wait_for_line(child, "status page http://", timeout)
        child.status_port = int(_PORT.search(line).group(1))
        return child.status_port

    def status(self, child: Child) -> dict | None:
        return fetch_status(child.status_port) if child.status_port else None

    def peers(self, child: Child) -> list[dict] | None:
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{child.status_port}/api/v1/peers", timeout=2
            ) as r:
                return [p for stage in json.loads(r.read())["stages"] for p in stage["peers"]]
        except OSError:
            return None

    def kill(self, child: Child, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal the daemon's main process only (what a crash or an operator does)."""
        child.proc.send_signal(sig)

    def log(self, child: Child) -> str:
        return child.log_path.read_text(errors="replace")


def small_manifest(
    path: Path,
    *,
    stages: int,
    layers: int,
    inner_steps: int = 50,
    group_size: int = 4,
    overlap: bool | None = None,
    cp_degree: int = 1,
    kv_rank: int = 0,
    kv_tokens: bool = False,
    documents: bool = False,
    optimizer: str = "adamw",
    weight_prediction: bool = False,
    outer_rank: int = 0,
    anchor_codec: str = "auto",
) -> str:
    """tiny with another stage cut, outer cadence H, gossip group size, overlapped outer
    rounds or not (None: tiny's, overlapped), context-parallel cells of `cp_degree`,
    another inner optimizer, weight prediction, low-rank outer factors (`outer_rank`) and
    the anchors' codec (written to `path`). With `documents`, the corpus is the built-in
    one cut into many documents (`speeches`, written beside `path`): windows pack
    several, and attention keeps them apart."""
    from agora_node.protocol.manifest import parse_manifest
    from agora_node.stages.manifest_files import load_manifest

    text = load_manifest("tiny").to_toml()
    text = text.replace("n_layers = 8", f"n_layers = {layers}")
    text = text.replace("count = 4", f"count = {stages}")
    text = text.replace("inner_steps = 50", f"inner_steps = {inner_steps}")
    text = text.replace("group_size = 4", f"group_size = {group_size}")
    if overlap is not None:  # else tiny's (overlapped rounds)
        assert "\noverlap = true\n" in text
        text = text.replace("\noverlap = true\n", f"\noverlap = {str(overlap).lower()}\n")
    text = text.replace("cp_degree = 1", f"cp_degree = {cp_degree}")
    text = text.replace("kv_rank = 0", f"kv_rank = {kv_rank}")
    text = text.replace("kv_tokens = false", f"kv_tokens = {str(kv_tokens).lower()}")
    text = text.replace('optimizer = "adamw"', f'optimizer = "{optimizer}"')
    text = text.replace(
        "weight_prediction = false", f"weight_prediction = {str(weight_prediction).lower()}"
    )
    assert 'anchor_codec = "auto"' in text
    text = text.replace('anchor_codec = "auto"', f'anchor_codec = "{anchor_codec}"')
    if outer_rank:
        assert "\nrank = 0\n" in text
        text = text.replace("\nrank = 0\n", f"\nrank = {outer_rank}\n")
    if documents:
        corpus = speeches(path.with_suffix(".jsonl"))
        source = 'source = "builtin:tinyshakespeare"\nformat = "text"'
        assert source in text
        text = text.replace(source, f'source = "{corpus}"\nformat = "jsonl"')
    parse_manifest(text)  # validate before a daemon sees it
    path.write_text(text)
    return str(path)


def speeches(path: Path) -> Path:
    """The built-in corpus as JSONL, one document per speech (blank-line separated)."""
    from importlib import resources

    text = resources.files("agora_node.stages").joinpath("corpus/tinyshakespeare.txt").read_text()
    with path.open("w", encoding="utf-8") as f:
        for speech in text.split("\n\n"):
            if speech.strip():
                f.write(json.dumps({"text": speech + "\n\n"}) + "\n")
    return path
