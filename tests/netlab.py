"""A network lab of Linux network namespaces: hosts on a switch, and hosts behind a
masquerading NAT router that can dial out but cannot be dialed.

    lab = NetLab.create()                  # needs root, `ip netns` and iptables
    boot = lab.public("boot")              # 11.X.0.N on the switch
    home = lab.behind_nat("home")          # 192.168.X.2 behind its own router
    lab.exec_prefix(home)                  # ["ip", "netns", "exec", NS]: run a command there
    lab.shape(home, 20, 100)               # its uplink 20 Mbit/s, downlink 100 (tc tbf)
    lab.destroy()                          # deletes every namespace it made (and their links)

Each lab takes its own name prefix and /16 from its pid, so labs of parallel runs do
not meet. Links are veth pairs; the switch is a bridge inside a namespace of its own,
so nothing touches the machine's own network: the test process reaches the hosts
only through `ip netns exec`, and the hosts reach nothing but each other. The switch's
net looks public (11.X.0.0/24, not RFC 1918) because libp2p treats a private address
as unroutable: a relay there never yields a relayed address (AutoRelay keeps only a
relay's public addresses); the packets still never leave the lab. (This
kernel has no netem: `shape` limits a host's uplink and downlink with tc tbf; latency
and loss are the transport's to emulate: comms/linkemu.py.)

`why_not()` says in one line why this machine cannot run a lab (not root, no
`ip netns`, no iptables), for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def why_not() -> str | None:
    """None if a lab can be built here, else why not (one line)."""
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns)"
    if shutil.which("ip") is None:
        return "the network lab needs iproute2's `ip`"
    if shutil.which("iptables") is None:
        return "the network lab needs iptables (apt-get install iptables)"
    probe = f"agprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError) as exc:
        return f"this machine cannot make network namespaces: {exc}"
    _run("ip", "netns", "del", probe)
    return None


@dataclass
class Host:
    name: str
    netns: str
    ip: str
    downlink: tuple[str, str] = ("", "")
    """(namespace, interface) of the far end of the host's link: what leaves there
    toward the host is its downlink (`NetLab.shape`)."""


@dataclass
class NetLab:
    prefix: str
    net: int
    """Second octet of the lab's public 11.N.0.0/24 and private 192.168.N.0/24 nets."""
    namespaces: list[str] = field(default_factory=list)
    hosts: dict[str, Host] = field(default_factory=dict)
    _next_public: int = 1

    @classmethod
    def create(cls) -> NetLab:
        pid = os.getpid()
        lab = cls(prefix=f"ag{pid % 100000}", net=100 + pid % 150)
        switch = lab._netns("sw")
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        return lab

    # ---- building ---------------------------------------------------------------------
    def _netns(self, name: str) -> str:
        netns = f"{self.prefix}-{name}"
        _run("ip", "netns", "add", netns)
        self.namespaces.append(netns)
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        return netns

    def _to_switch(self, netns: str, ip: str) -> tuple[str, str]:
        """A veth from `netns` (eth0, `ip`/24) to the switch; (switch namespace, the
        switch-side interface's name)."""
        outer = f"v{self.prefix[2:]}{len(self.namespaces)}"
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", outer, "netns", f"{self.prefix}-sw")
        _run("ip", "-n", f"{self.prefix}-sw", "link", "set", outer, "master", "br0", "up")
        _run("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        return f"{self.prefix}-sw", outer

    def _public_ip(self) -> str:
        ip = f"11.{self.net}.0.{self._next_public}"
        self._next_public += 1
        return ip

    def public(self, name: str) -> Host:
        """A host on the switch: dialable by every other host of the lab."""
        netns = self._netns(name)
        ip = self._public_ip()
        host = Host(name, netns, ip, self._to_switch(netns, ip))
        self.hosts[name] = host
        return host

    def behind_nat(self, name: str, *, symmetric: bool = False) -> Host:
        """A host behind a router of its own that masquerades it onto the switch: it can
        dial every public host; nothing can dial it. `symmetric`: each connection out gets
        a random source port (a "hard" NAT), so two such hosts cannot open a connection to
        each other by dialing at once (TCP simultaneous open through two plain masquerades
        did, in this lab, now and then)."""
        router = self._netns(f"{name}-nat")
        self._to_switch(router, self._public_ip())
        netns = self._netns(name)
        private = f"192.168.{self.net}"
        _run("ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0",
             "netns", netns)  # fmt: skip
        _run("ip", "-n", router, "addr", "add", f"{private}.1/24", "dev", "lan0")
        _run("ip", "-n", router, "link", "set", "lan0", "up")
        _run("ip", "-n", netns, "addr", "add", f"{private}.2/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "route", "add", "default", "via", f"{private}.1")
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        nat = ["ip", "netns", "exec", router, "iptables"]
        _run(*nat, "-t", "nat", "-A", "POSTROUTING", "-s", f"{private}.0/24", "-o", "eth0",
             "-j", "MASQUERADE", *(["--random-fully"] if symmetric else []))  # fmt: skip
        # like a home router: replies to what the inside opened pass, nothing else comes in
        _run(*nat, "-A", "FORWARD", "-i", "eth0", "-m", "state", "--state",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
        _run(*nat, "-A", "FORWARD", "-i", "eth0", "-j", "DROP")
        host = Host(name, netns, f"{private}.2", (router, "lan0"))
        self.hosts[name] = host
        return host

    # ---- using ------------------------------------------------------------------------
    @staticmethod
    def exec_prefix(host: Host) -> list[str]:
        return ["ip", "netns", "exec", host.netns]

    def run_in(self, host: Host, *argv: str) -> str:
        return _run(*self.exec_prefix(host), *argv)

    def shape(self, host: Host, up_mbit: float, down_mbit: float) -> None:
        """Limit what `host` sends (its uplink) and what reaches it (its downlink) to these
        rates, with the kernel's token bucket (tbf) on each end of its link; a queue of
        at most 200 ms of traffic before drops, like a home router's buffer."""
        for (netns, dev), mbit in (((host.netns, "eth0"), up_mbit), (host.downlink, down_mbit)):
            burst = max(32_000, int(mbit * 1e6 / 8 / 250))  # at least a tick's worth (HZ 250)
            _run("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root",
                 "tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms")  # fmt: skip

    def unshape(self, host: Host) -> None:
        """Lift `shape`: the host's links at full speed again."""
        for netns, dev in ((host.netns, "eth0"), host.downlink):
            _run("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root")

    def shaper_counts(self, host: Host) -> dict[str, dict[str, int]]:
        """What the uplink's and downlink's shapers let through and held back:
        {"up"|"down": {"sent_bytes", "dropped", "overlimits"}}."""
        out = {}
        for side, (netns, dev) in (("up", (host.netns, "eth0")), ("down", host.downlink)):
            text = _run("ip", "netns", "exec", netns, "tc", "-s", "qdisc", "show", "dev", dev)
            if " tbf " not in f" {text}":
                raise RuntimeError(f"{host.name}'s {side}link is not shaped: {text.strip()}")
            words = text.replace("(", " ").replace(")", " ").replace(",", " ").split()
            out[side] = {
                "sent_bytes": int(words[words.index("Sent") + 1]),
                "dropped": int(words[words.index("dropped") + 1]),
                "overlimits": int(words[words.index("overlimits") + 1]),
            }
        return out

    def partition(self, side: list[Host], rest: list[Host]) -> None:
        """Cut every packet between `side` and `rest` (both ways, in `side`'s namespaces;
        established connections too): two halves of one swarm that cannot reach each other."""
        for host in side:
            for other in rest:
                self.run_in(host, "iptables", "-A", "INPUT", "-s", other.ip, "-j", "DROP")
                self.run_in(host, "iptables", "-A", "OUTPUT", "-d", other.ip, "-j", "DROP")

    def heal(self, side: list[Host]) -> None:
        """Undo `partition` (flush the filter rules of `side`'s namespaces)."""
        for host in side:
            self.run_in(host, "iptables", "-F")

    def destroy(self) -> list[str]:
        """Delete every namespace of the lab (their veths go with them); the names of
        those that could not be deleted."""
        left = []
        for netns in reversed(self.namespaces):
            try:
                _run("ip", "netns", "del", netns)
            except RuntimeError:
                left.append(netns)
        self.namespaces = left
        return left

    def leftovers(self) -> list[str]:
        """Namespaces of this lab that still exist (none after destroy())."""
        existing = _run("ip", "netns", "list")
        return [line.split()[0] for line in existing.splitlines() if line.startswith(self.prefix)]
