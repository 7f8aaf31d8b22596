"""stages/flat.py: a stage's tensors as one host float32 vector and back."""

import pytest
import torch

from agora_node.stages.flat import host_flat, write_flat

pytestmark = pytest.mark.timeout(30)


def test_host_flat_and_write_flat_round_trip_in_order_and_dtype():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_(True)
    b = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    flat = host_flat([a, b])
    assert flat.dtype == torch.float32 and flat.device.type == "cpu"
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0.5, -1.0]
    write_flat([a, b], flat * 2)  # a leaf that requires grad: written without autograd
    assert a.tolist() == [[0, 2, 4], [6, 8, 10]] and b.dtype == torch.bfloat16
    assert b.tolist() == [1.0, -2.0]


def test_host_flat_never_concatenates_on_the_device(monkeypatch):
    # a device-side cat would need a whole extra copy of the stage's weights there
    def no_cat(*_args, **_kwargs):  # noqa: ANN202
        raise AssertionError("torch.cat called")

    monkeypatch.setattr(torch, "cat", no_cat)
    assert host_flat([torch.ones(3), torch.zeros(2)]).tolist() == [1, 1, 1, 0, 0]
