"""Forward requests as an upstream stage sends them, and a pipeline's answer to one, for
the data-plane tests (no network: the request goes straight to `Pipeline.handle`)."""

import asyncio

import torch

from agora_node.comms.pipeline_wire import (
    ForwardHeader,
    ResponseHeader,
    decode_response,
    encode_forward,
)
from agora_node.compression import ActivationCodec
from agora_node.node.pipeline import Pipeline
from agora_node.protocol.manifest import Manifest


def forward_request(
    m: Manifest,
    *,
    stage: int,
    width: int,
    seed: int | None = None,
    batch: int | None = None,
    mb_id: str = "x",
    mode: str = "fp32",
    train: bool = True,
) -> bytes:
    """A request of `batch` rows (a whole micro-batch by default) of random tokens and
    boundary coefficients (from `seed`, when given), as a head's loss_scale weighs it."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    rows, s = m.inner.micro_batch if batch is None else batch, m.model.seq_len
    header = ForwardHeader(
        run_id=m.run_id, mb_id=mb_id, stage=stage, batch=rows, seq=s, width=width,
        loss_scale=m.inner.micro_batch / m.inner.local_batch, train=train,
    )  # fmt: skip
    tokens = torch.randint(0, m.model.vocab_size, (rows, s + 1), generator=g)
    c = torch.randn(rows, s, width, generator=g)
    return encode_forward(header, tokens, ActivationCodec(mode=mode).encode(c))


async def answer(p: Pipeline, remote: str, data: bytes) -> bytes:
    """What `p` answers `remote`'s request, whole."""
    return b"".join([chunk async for chunk in p.handle(remote, data)])


def serve(p: Pipeline, remote: str, data: bytes) -> ResponseHeader:
    """`answer`, run to its end; the reply's header."""
    return decode_response(asyncio.run(answer(p, remote, data)))[0]
