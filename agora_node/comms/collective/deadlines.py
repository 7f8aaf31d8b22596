"""How long each step of a collective (allreduce.py) may take: a fixed allowance plus the
bytes it moves at a worst-case rate, so a large stage gets longer than a small one and
every member of a group computes the same deadlines from the same plan."""

from __future__ import annotations

from dataclasses import dataclass

from agora_node.comms.collective.payload import WireFormat


@dataclass(frozen=True, kw_only=True)
class Deadlines:
    """Deadlines, in seconds from the member's own start, scaled by what must move."""

    base: float = 5.0
    """Fixed allowance per step: latency, scheduling, a peer a little behind."""
    min_rate: float = 10e6
    """Bytes per second a member's link and codec are assumed to sustain at worst."""

    def reduce(self, numel: int, n: int, fmt: WireFormat) -> float:
        part = numel / n * fmt.bits(fmt.part) / 8
        return self.base + (4 * numel + (n - 1) * part) / self.min_rate

    def gather(self, numel: int, n: int, fmt: WireFormat) -> float:
        result = numel / n * fmt.bits(fmt.result) / 8
        return self.reduce(numel, n, fmt) + self.base + (n - 1) * result / self.min_rate

    def repair(self, numel: int, n: int, fmt: WireFormat) -> float:
        span = numel / n * (fmt.bits(fmt.part) + fmt.bits(fmt.result)) / 8
        return self.base + (n - 1) * span / self.min_rate

    def attempt_end(self, attempt: int, numel: int, n: int, fmt: WireFormat) -> float:
        return self.gather(numel, n, fmt) + attempt * self.repair(numel, n, fmt)

    def worst_case(self, numel: int, n: int, fmt: WireFormat) -> float:
        """When a member gives up on the last span: the round's hard deadline."""
        return self.attempt_end(max(0, n - 1), numel, n, fmt)
