"""Over real hivemind DHT nodes on 127.0.0.1: a stranger's DHT (no validator) stores a
plain value with a far expiry under a stage's key. hivemind replaces a key's whole
dictionary by a plain value with a later expiry, so before the validator refused plain
values away from their manifest key, the honest node kept the junk, refused every
record after it, and the stage's directory read empty for as long as the stranger chose."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
from pathlib import Path

import hivemind
import pytest
from hivemind.utils.timed_storage import get_dht_time

from agora_node.comms.host import Host, HostConfig
from agora_node.protocol.identity import Identity
from agora_node.protocol.names import manifest_key, stage_key
from agora_node.protocol.records import NodeRecord
from agora_node.stages.manifest_files import load_manifest

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]


async def test_a_plain_value_cannot_empty_a_stage_s_directory() -> None:
    identity = Identity.generate()
    key_path = Path(tempfile.mkdtemp(prefix="agora-squat-")) / "identity.key"
    key_path.write_bytes(identity.to_libp2p_bytes())
    honest = await Host.start(HostConfig(identity_path=str(key_path)))
    stranger = None
    try:
        maddrs = [str(a) for a in await honest.visible_maddrs()]
        stranger = hivemind.DHT(
            initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
        )
        manifest = load_manifest("tiny")
        key = stage_key(manifest.run_id, 1)
        far = get_dht_time() + 365 * 86400
        stranger.store(key, b"junk", far)  # to its own storage and to the honest node
        record = NodeRecord(
            run_id=manifest.run_id, peer_id=identity.peer_id, stage=1, state="active", ttl=30
        )
        # (the stranger's own storage refuses it: its junk expires later)
        await honest.store(key, record.sign(identity), 30, subkey=identity.peer_id)
        found = await honest.get(key)  # asks the stranger too, and checks its answer
        assert isinstance(found, dict) and identity.peer_id in found, found
        # the one plain value the DHT keeps: a manifest, under the key its bytes hash to
        assert await honest.store(manifest_key(manifest.run_id), manifest.canonical_bytes(), 60)
        assert await honest.get(manifest_key(manifest.run_id)) == manifest.canonical_bytes()
    finally:
        if stranger is not None:
            pid = stranger.pid
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(stranger.shutdown), 15)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await honest.shutdown()
