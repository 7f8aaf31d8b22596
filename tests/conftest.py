"""Shared pytest fixtures."""

import os

import pytest

# Keep torch from oversubscribing the 2-core CI machine when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def mosquitto(tmp_path):
    """A real MQTT broker on a free port of 127.0.0.1, stopped by pid afterwards."""
    from tests.broker import MOSQUITTO, Mosquitto

    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; .ci/run does)")
    pytest.importorskip("aiomqtt", reason="aiomqtt is not installed (the mqtt or dev extra)")
    broker = Mosquitto(tmp_path)
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()
