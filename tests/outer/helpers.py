"""In-process groups for unit tests: members of one collective in one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from agora_node.comms.collective import (
    AggregationSpec,
    AllReduce,
    Deadlines,
    GroupPlan,
    LocalNetwork,
    Outcome,
    PartEncoder,
    WireFormat,
    plain_format,
)
from agora_node.comms.collective.proofs import Signing

# roomy enough that a loaded CI machine never drops a part; tests of timeouts pass their own
LOCAL = Deadlines(base=2.0, min_rate=1e9)


def peers(n: int) -> list[str]:
    return [f"peer{i}" for i in range(n)]


async def run_group(
    values: dict[str, torch.Tensor],
    *,
    weights: dict[str, float] | None = None,
    fmt: WireFormat | None = None,
    aggregation: AggregationSpec | None = None,
    deadlines: Deadlines = LOCAL,
    network: LocalNetwork | None = None,
    transports: dict[str, object] | None = None,
    skip: set[str] = frozenset(),
    encoders: dict[str, PartEncoder] | None = None,
    before: dict[str, Callable[[], Awaitable[None]]] | None = None,
    round_no: int = 0,
    block: int = 64,
    verify: bool = False,
    ignore: dict[str, frozenset[str]] | None = None,
    signing: dict[str, Signing] | None = None,
) -> dict[str, Outcome]:
    """Run one collective among `values`' keys; members in `skip` register but never run,
    and a member in `before` first awaits its entry (to order events deterministically)."""
    fmt = fmt or plain_format()
    network = network or LocalNetwork()
    members = tuple(values)
    numel = next(iter(values.values())).numel()
    plan = GroupPlan(round=round_no, phase="delta", members=members, numel=numel, block=block)
    books = {
        p: network.responders[p].book
        if p in network.responders
        else network.join(p, signing.get(p) if signing else None)
        for p in members
    }
    states = {p: books[p].register(plan) for p in members}

    async def member(p: str) -> Outcome:
        if before and p in before:
            await before[p]()
        transport = (transports or {}).get(p) or network.transport(p)
        run = AllReduce(
            states[p],
            transport,
            fmt=fmt,
            encoder=(encoders or {}).get(p) or PartEncoder(fmt),
            aggregation=aggregation or AggregationSpec(),
            deadlines=deadlines,
            verify=verify,
            ignore=(ignore or {}).get(p, frozenset()),
            signing=(signing or {}).get(p),
        )
        return await run.run(values[p], (weights or {}).get(p, 1.0))

    running = [p for p in members if p not in skip]
    outs = await asyncio.gather(*(member(p) for p in running))
    return dict(zip(running, outs, strict=True))


def random_values(n: int, numel: int, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Like honest pseudo-gradients: a shared direction plus each member's own noise
    (independent vectors agree on nothing, and the direction check would refuse some)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g)
    return {p: (common + torch.randn(numel, generator=g)) * scale for p in peers(n)}


def all_equal(outs: dict[str, Outcome]) -> bool:
    first = next(iter(outs.values())).value
    return all(torch.equal(first, o.value) for o in outs.values())


def run(coro_fn: Callable, *args, **kwargs):
    return asyncio.run(coro_fn(*args, **kwargs))
