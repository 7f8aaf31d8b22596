"""A real agora-node daemon that lies on the pipeline, for tests: `python -m
tests.integration.lying_replica join ...` with AGORA_LIE set to one lie:

- gradient: the gradients it returns upstream are negated (their norm unchanged, so no
  norm check can see it);
- loss: the loss it reports is 0.01;
- noise: the gradients it returns are noise of the same spread (no direction);
- activations: as a head, the activations it sends are noise of the same spread.

Everything else it does as an honest replica does: it trains, answers probes and takes
part in outer rounds.
"""

from __future__ import annotations

import os
import sys

import torch

from agora_node.node.pipeline import Pipeline

LIE = os.environ.get("AGORA_LIE", "gradient")
_honest_ok = Pipeline._ok


async def _lying_ok(self, loss, grad):  # noqa: ANN001, ANN202
    if LIE == "gradient" and grad is not None:
        grad = -grad
    if LIE == "noise" and grad is not None:
        grad = torch.randn_like(grad) * grad.float().std()
    if LIE == "loss":
        loss = 0.01
    return await _honest_ok(self, loss, grad)


Pipeline._ok = _lying_ok
_honest_send = Pipeline.send


async def _lying_send(self, header, tokens, c):  # noqa: ANN001, ANN202
    if LIE == "activations" and header.train:
        c = torch.randn_like(c) * c.float().std()
    return await _honest_send(self, header, tokens, c)


Pipeline.send = _lying_send

if __name__ == "__main__":
    from agora_node.node.cli import entry

    sys.exit(entry())
