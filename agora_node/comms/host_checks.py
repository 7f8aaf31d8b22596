"""What `Host.start` checks before it starts libp2p, and how it explains a failure.

Every failure is a `HostError` whose message is one line for the operator: what is wrong
and the fix, never hivemind's or p2pd's own text alone.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Sequence

from hivemind.utils.multiaddr import Multiaddr


class HostError(RuntimeError):
    """The node's network host could not start (message is one line for the operator)."""


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


def check_maddr(maddr: str) -> None:
    try:
        Multiaddr(maddr)
    except Exception as exc:
        raise HostError(f"invalid multiaddr {maddr!r}: {one_line(exc)}") from None


def check_port_free(maddr: str) -> None:
    """A fixed TCP port someone listens on is refused here: p2pd binds with SO_REUSEPORT,
    so beside another libp2p daemon it would start and share the port, each taking some of
    the connections dialed to it."""
    parts = str(maddr).split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return
    if not parts[4].isdigit() or int(parts[4]) == 0:
        return
    family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 in this kernel: p2pd will say
        return
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no user
        if family == socket.AF_INET6:  # as p2pd's tcp6 listener: an IPv4 one does not clash
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            probe.bind((parts[2], int(parts[4])))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # not ours to judge (say an address this host lacks): p2pd will say
            raise HostError(
                f"a listen address is already in use ({maddr}): stop what uses it or pass "
                "--host-maddrs with another port"
            ) from None


_CLOCK = re.compile(r"local time must be within (\S+) seconds.*local: ([\d.]+), peer: ([\d.]+)")


def clock_error(exc: BaseException) -> HostError | None:
    """hivemind's clock check, which it raises as text only: the offset and the fix."""
    clock = _CLOCK.search(str(exc))
    if clock is None:
        return None
    allowed, local, peer = (float(x) for x in clock.groups())
    return HostError(
        f"this machine's clock is {local - peer:+.1f}s off the swarm's (hivemind allows "
        f"{allowed:g}s): enable time synchronization (e.g. `timedatectl set-ntp true`) and retry"
    )


def explain_start_failure(
    exc: BaseException, initial_peers: Sequence[str], host_maddrs: Sequence[str]
) -> HostError:
    """libp2p's failure to start as one line naming the cause and the fix."""
    text = one_line(exc)
    clock = clock_error(exc)
    if clock is not None:
        return clock
    if "bootstrap" in text.lower() or "connect" in text.lower():
        peers = ", ".join(initial_peers)
        return HostError(
            f"could not reach any initial peer ({peers}): check the address, its /p2p/ peer "
            "id (a peer that answers with another id is refused), and that it runs"
        )
    if "address already in use" in text.lower():
        return HostError(
            f"a listen address is already in use ({', '.join(host_maddrs)}): stop what "
            "uses it or pass --host-maddrs with another port"
        )
    return HostError(f"libp2p daemon failed to start: {text}")
