"""Shared pytest fixtures."""

import os

import pytest

# Keep torch from oversubscribing the 2-core CI machine when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def mosquitto(tmp_path):
    """A real MQTT broker on a free port of 127.0.0.1, stopped by pid afterwards."""
    yield from _mosquitto(tmp_path)


BROKER_LOGIN = ("agora", "pass:word with a colon")


@pytest.fixture
def mosquitto_login(tmp_path):
    """The same, letting in only BROKER_LOGIN (a password file; no anonymous clients)."""
    from tests.broker import MOSQUITTO_PASSWD

    if MOSQUITTO_PASSWD is None:
        pytest.skip("mosquitto_passwd is not installed (it comes with mosquitto)")
    yield from _mosquitto(tmp_path, BROKER_LOGIN)


def _mosquitto(tmp_path, login=None):
    from tests.broker import MOSQUITTO, Mosquitto

    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run does)")
    pytest.importorskip("aiomqtt", reason="aiomqtt is not installed (the mqtt or dev extra)")
    broker = Mosquitto(tmp_path, login)
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()
