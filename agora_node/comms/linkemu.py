"""Link emulation in the transport layer: bandwidth and latency for benchmarks and tests.

This kernel has no netem, so a slow internet link is emulated where our bytes
leave: every frame a node writes on a pipeline or state stream first waits for
its turn on a shared uplink of `bandwidth_mbit` (serialization delay); a frame
that carries a payload then also waits `latency_ms` of one-way propagation, so a
message (its data frame, then an empty END frame right behind it) pays the
latency once, as on a real link. A request/response round trip therefore costs
2 x latency plus both transfer times. (Until 2026-11-30 the empty END frame slept
the latency too, after its bytes had left: it did not arrive later, but the
sender's task, and with it the stream and its guard slot, was held one latency
longer.) Membership's messages pay the latency only (`control_message`). DHT traffic
(hivemind's own streams) is not shaped.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_mbit: float
    latency_ms: float

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """'100,50' -> 100 Mbit/s, 50 ms one way."""
        try:
            bw, lat = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(
                f"link spec {text!r} must be 'MBIT_PER_S,LATENCY_MS', e.g. 100,50"
            ) from None
        if not (math.isfinite(bw) and math.isfinite(lat)) or bw <= 0 or lat < 0:  # nan, inf
            raise ValueError(
                f"link spec {text!r}: bandwidth must be a finite number > 0 and latency a finite number >= 0"
            )
        return cls(bw, lat)


class LinkEmulator:
    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._uplink_free_at = 0.0

    async def transmit(self, nbytes: int, *, propagate: bool = True) -> None:
        """Wait for the uplink to carry `nbytes`, then (if `propagate`) one latency."""
        now = time.monotonic()
        start = max(now, self._uplink_free_at)
        self._uplink_free_at = start + nbytes * 8 / (self.spec.bandwidth_mbit * 1e6)
        latency = self.spec.latency_ms / 1000 if propagate else 0.0
        await asyncio.sleep(self._uplink_free_at - now + latency)

    async def propagate(self) -> None:
        """One latency and no uplink time: a datagram-sized control message."""
        await asyncio.sleep(self.spec.latency_ms / 1000)


_active: LinkEmulator | None = None


def configure(spec: LinkSpec | None) -> None:
    """Shape every frame this process writes from now on (None: no shaping)."""
    global _active
    _active = LinkEmulator(spec) if spec is not None else None


def shaping() -> bool:
    """Whether this process's frames are shaped (`configure` was given a link)."""
    return _active is not None


async def transmit(nbytes: int, *, propagate: bool = True) -> None:
    if _active is not None:
        await _active.transmit(nbytes, propagate=propagate)


async def control_message() -> None:
    """Membership's datagrams pay the link's latency (so probes measure the emulated round
    trip) but not its uplink queue, which on a real link they would share."""
    if _active is not None:
        await _active.propagate()
