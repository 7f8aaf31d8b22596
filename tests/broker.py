"""A real MQTT broker for tests (Debian's mosquitto), and a subscriber that waits with a deadline.

The broker runs as `mosquitto -p PORT` (local-only mode: 127.0.0.1 and ::1) and is
stopped by pid. Tests that need it skip with a reason where mosquitto is missing
(`.ci/run` installs it where it can).
"""

from __future__ import annotations

import asyncio
import getpass
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MOSQUITTO = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/sbin")
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mosquitto:
    def __init__(self, workdir: Path, login: tuple[str, str] | None = None) -> None:
        """`login`: only this user and password may connect (a password file), else anyone."""
        self.port = free_port()
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.log_path = workdir / "mosquitto.log"
        self.proc: subprocess.Popen | None = None
        self.args = ["-p", str(self.port)]
        if login is not None:
            passwords, conf = workdir / "mosquitto.passwd", workdir / "mosquitto.conf"
            subprocess.run([MOSQUITTO_PASSWD, "-b", "-c", passwords, *login], check=True)
            conf.write_text(
                f"listener {self.port} 127.0.0.1\nallow_anonymous false\n"
                f"password_file {passwords}\nuser {getpass.getuser()}\n"  # root stays root
            )
            self.args = ["-c", str(conf)]

    def start(self, timeout: float = 15) -> None:
        """Start on self.port (again, after a stop) and wait until it accepts connections."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [MOSQUITTO, *self.args], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)  # polling interval of a deadline-bounded wait
        raise RuntimeError(f"mosquitto did not listen on {self.port} within {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def receive(
    port: int,
    topic: str,
    match: Callable[[str, dict[str, Any]], bool],
    timeout: float,
    then: Callable[[], None] | None = None,
    login: tuple[str, str] = (None, None),
) -> tuple[str, dict[str, Any]]:
    """Subscribe to `topic` from a fresh client; the first (topic, JSON) that `match`es.

    `then` runs once the subscription is in place (to cause what is awaited); `login`: the
    subscriber's user and password.
    """
    import aiomqtt

    seen: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            user, password = login
            async with aiomqtt.Client(
                "127.0.0.1", port, timeout=timeout, username=user, password=password
            ) as client:
                await client.subscribe(topic, qos=1)
                if then is not None:
                    then()
                async for msg in client.messages:
                    data = json.loads(msg.payload)
                    seen.append(f"{msg.topic.value} {data}")
                    if match(msg.topic.value, data):
                        return msg.topic.value, data
    except TimeoutError:
        pass
    raise AssertionError(f"no matching message on {topic} within {timeout:.0f}s; saw {seen[-5:]}")


def receive_sync(*args: Any, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    return asyncio.run(receive(*args, **kwargs))
