"""Replayed pseudo-gradients: a member sending, in a later round, a delta it already sent.

Honest deltas come from new data every round: one member's consecutive deltas measured
at cosine 0.86-0.95 (bench/byzantine.py, tiny, H=1, where they are most alike), and
are never equal. A replay of an earlier delta is equal up to the wire's rounding:
cosine 0.99986-0.99995 between two int8 sends of one delta through error feedback,
0.99999 in bf16, 1 in fp32. Its direction is a plausible one, so the norm and
direction checks (aggregate.py) may let it through, and it drags every round
towards an old one.

A reducer cannot compare whole deltas: it sees only the parts of the spans it reduces
(and witnesses), and which span it reduces changes from round to round. So it keeps,
per sender, *samples* of the delta parts it saw in recent rounds at global positions
(every `stride`-th coordinate from an offset this node draws at random, so a sender
cannot know which coordinates are compared), and compares a new part with the
sender's earlier ones wherever their samples overlap: cosine at least REPLAY_COSINE
and norms within NORM_TOLERANCE is a replay.

The same goes for a part that repeats an earlier round's *mixed* delta, which every
member holds after a round (`remember_mixed`): a free rider that trains nothing and
sends the stage's last consensus back looks more honest than anyone to the norm and
direction checks, but it is a replay all the same.

A replay is flagged, never refused in the round: an owner and its witness saw
different histories, and refusing on history would make their results differ. The
flag bans the sender (node/suspects.py, reason `replay`); its parts are then dropped
by this reducer and, once a majority of round entries name it, it is left out of the
stage's rounds.

Limits: a replay is caught only of a delta sent in the last `rounds` rounds, where
this member saw overlapping samples (with 3 members each one reduces and witnesses
two of the three spans, so consecutive rounds always overlap), and only when
near-exact: a replay with noise added evades it (CenteredClip and the direction check
bound that one), and so does any replay over int4, whose rounding through error
feedback leaves two sends of one delta at cosine 0.95-0.98, as alike as honest deltas.
Bounded: at most `max_peers` senders (least recently seen forgotten first), `rounds`
rounds each, and about `samples` values in at most MAX_PARTS_PER_ROUND parts per sender
and round.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

REPLAY_COSINE = 0.999
"""At or above: the same delta. 7x closer to 1 than an int8 resend's 0.99986, 50x
closer than the most alike honest consecutive deltas measured (0.95)."""
MAX_PARTS_PER_ROUND = 8
NORM_TOLERANCE = 0.01
"""Relative difference of the overlapping samples' norms below which they count equal."""


@dataclass
class _Seen:
    positions: Tensor
    """Global coordinates sampled (int64, sorted)."""
    values: Tensor


class ReplayMemory:
    """What a reducer remembers of each sender's recent delta parts (see the module
    docstring). `check` compares a part with the sender's earlier ones and remembers it."""

    def __init__(
        self,
        numel: int,
        *,
        samples: int = 8192,
        rounds: int = 8,
        max_peers: int = 64,
        min_overlap: int = 64,
        offset: int | None = None,
    ) -> None:
        self.stride = max(1, numel // samples)
        self.offset = random.randrange(self.stride) if offset is None else offset % self.stride
        self.rounds, self.max_peers, self.min_overlap = rounds, max_peers, min_overlap
        self._seen: OrderedDict[str, dict[int, list[_Seen]]] = OrderedDict()
        self._mixed: dict[int, _Seen] = {}
        """Samples of the mixed delta of each recent round (every member's result)."""
        self._lock = threading.Lock()  # an owner's and a witness's reduction may overlap

    def check(self, sender: str, round_no: int, lo: int, part: Tensor) -> bool:
        """Whether `part` (the sender's delta over coordinates lo..lo+len) repeats a part
        it sent in an earlier round; then remember its samples for round `round_no`."""
        positions = self._positions(lo, part.numel())
        if positions.numel() == 0:
            return False
        values = part.detach().reshape(-1)[positions - lo].float()
        if not bool(torch.isfinite(values).all()) or float(values.norm()) == 0.0:
            return False  # nothing to compare (zero deltas of warming members, junk)
        with self._lock:
            return self._check_locked(sender, round_no, positions, values)

    def remember_mixed(self, round_no: int, mixed: Tensor) -> None:
        """Keep samples of round `round_no`'s mixed delta (the whole flat vector): a part of
        a later round that repeats it is a replay too."""
        positions = self._positions(0, mixed.numel())
        values = mixed.detach().reshape(-1)[positions].float().clone()
        if not bool(torch.isfinite(values).all()) or float(values.norm()) == 0.0:
            return
        with self._lock:
            self._mixed[round_no] = _Seen(positions, values)
            for old in sorted(self._mixed)[: -self.rounds]:
                del self._mixed[old]

    def _check_locked(self, sender: str, round_no: int, positions: Tensor, values: Tensor) -> bool:
        history = self._seen.setdefault(sender, {})
        self._seen.move_to_end(sender)
        earlier = [seen for past, parts in history.items() if past < round_no for seen in parts]
        earlier += [seen for past, seen in self._mixed.items() if past < round_no]
        replayed = any(self._same(seen, positions, values) for seen in earlier)
        parts = history.setdefault(round_no, [])
        if len(parts) < MAX_PARTS_PER_ROUND:  # spans reduced and witnessed in one round
            parts.append(_Seen(positions, values.clone()))
        for old in sorted(history)[: -self.rounds]:
            del history[old]
        while len(self._seen) > self.max_peers:
            self._seen.popitem(last=False)
        return replayed

    def _positions(self, lo: int, n: int) -> Tensor:
        first = lo + (self.offset - lo) % self.stride
        return torch.arange(first, lo + n, self.stride, dtype=torch.int64)

    def _same(self, seen: _Seen, positions: Tensor, values: Tensor) -> bool:
        mask_new = torch.isin(positions, seen.positions)
        if int(mask_new.sum()) < self.min_overlap:
            return False
        mask_old = torch.isin(seen.positions, positions)
        return _equalish(values[mask_new], seen.values[mask_old])


def _equalish(a: Tensor, b: Tensor) -> bool:
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0 or abs(na - nb) > NORM_TOLERANCE * max(na, nb):
        return False
    return float(torch.dot(a.double(), b.double())) / (na * nb) >= REPLAY_COSINE
