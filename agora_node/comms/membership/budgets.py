"""What one sender's messages may cost a member (swim.py): its event loop's time on
signature checks, and full-table answers. Identities are free, so each is bounded per
sender and in all.

- Item signatures checked: at most VERIFY_BUDGET per message, VERIFY_RATE_PER_SENDER
  per sender per second (a burst of twice that), and VERIFY_RATE per second in all;
  live members that answered our probes share a second VERIFY_RATE, so strangers' junk
  cannot starve them. What is over waits for a later message.
- Push-pull answers (a whole table each, up to megabytes): one per peer per quarter
  push-pull interval (an honest member starts one exchange per interval).
"""

from __future__ import annotations

from collections import OrderedDict

from agora_node.comms.guard import TokenBucket

VERIFY_BUDGET = 512
"""Item signatures checked per received message, at most (about 20 ms of the loop): a
push-pull carries a whole table (8192 members), so a newcomer learns a big swarm over a
few exchanges, and a stranger's forged entries cost the loop no more than that."""
VERIFY_RATE_PER_SENDER = 512.0
"""...and per sender per second (a burst of twice that): the guard lets a peer send 50
messages a second, whose 512 checks each were a second of the loop's time per second."""
VERIFY_RATE = 4096.0
"""...and in all per second (a burst of twice that; about 15% of a core): fresh keys are
free. Honest members' news costs far less (a thousand members: under a hundred a second).
Live members that answered our probes share another such allowance, so strangers' junk
cannot starve them."""


class SenderBudgets:
    """Per sender (the most recent `max_senders`) and in all: see the module docstring."""

    def __init__(self, max_senders: int, push_pull_interval_s: float, now: float) -> None:
        self.max_senders = max_senders
        self.push_pull_window_s = push_pull_interval_s / 4
        self._checks: OrderedDict[str, TokenBucket] = OrderedDict()
        self._shared = TokenBucket(VERIFY_RATE, 2 * VERIFY_RATE, now)
        self._probed = TokenBucket(VERIFY_RATE, 2 * VERIFY_RATE, now)
        self._answered: dict[str, float] = {}

    def checks(self, sender: str, probed: bool, now: float) -> tuple[int, list[TokenBucket]]:
        """The signature checks a message of `sender` may cost (`probed`: a live member
        that answered our probes), and the buckets to `spend` what it used from."""
        mine = self._checks.pop(sender, None)
        if mine is None:
            mine = TokenBucket(VERIFY_RATE_PER_SENDER, 2 * VERIFY_RATE_PER_SENDER, now)
        self._checks[sender] = mine  # newest last
        while len(self._checks) > self.max_senders:
            self._checks.popitem(last=False)
        shared = self._probed if probed else self._shared
        return min(VERIFY_BUDGET, mine.left(now), shared.left(now)), [mine, shared]

    def may_answer_push_pull(self, peer: str, now: float) -> bool:
        window, answered = self.push_pull_window_s, self._answered
        if len(answered) >= self.max_senders:
            for old in [p for p, at in answered.items() if now - at >= window]:
                del answered[old]
        at = answered.get(peer)
        if (at is not None and now - at < window) or len(answered) >= self.max_senders:
            return False
        answered[peer] = now
        return True
