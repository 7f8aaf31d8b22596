"""Benchmark the codecs: throughput, size versus float32, and error.

Two workloads: a pseudo-gradient (gaussian with per-chunk scales and rare outliers, as layers
of different magnitude give) through quantize + zstd framing, and a stage-boundary activation
[8, 256, 32] through ActivationCodec.

    python bench/codec.py [--json] [--numel N] [--threads T] [--repeat R]

MB/s counts float32 input bytes. Single-threaded by default so numbers compare across hosts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from agora_node.compression import (
    ActivationCodec,
    Codec,
    decode_tensor,
    encode_frame,
    quantize,
    relative_error,
)
from agora_node.compression.framing import FLAG_ZSTD

GRADIENT_CODECS = [
    ("fp32", Codec.FP32, None),
    ("bf16", Codec.BF16, None),
    ("int8", Codec.INT8, None),
    ("int8+rot", Codec.INT8, 0),
    ("int4", Codec.INT4, None),
    ("int4+rot", Codec.INT4, 0),
]
ACTIVATION_SHAPE = (8, 256, 32)


def pseudo_gradient(numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    chunk = 4096
    scales = torch.exp(torch.randn(-(-numel // chunk), generator=g)).repeat_interleave(chunk)
    x = x * scales[:numel] * 1e-3
    x[::10_000] *= 30.0
    return x


def best_time(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def bench_gradient(numel: int, repeat: int) -> list[dict[str, Any]]:
    x = pseudo_gradient(numel)
    mb = 4 * numel / 1e6
    rows = []
    for name, codec, seed in GRADIENT_CODECS:
        enc_s, frame = best_time(
            lambda c=codec, s=seed: encode_frame(quantize(x, c, seed=s)), repeat
        )
        dec_s, y = best_time(lambda f=frame: decode_tensor(f), repeat)
        rows.append({
            "codec": name,
            "encode_MBps": round(mb / enc_s, 1),
            "decode_MBps": round(mb / dec_s, 1),
            "ratio_vs_fp32": round(len(frame) / (4 * numel), 4),
            "zstd": bool(frame[7] & FLAG_ZSTD),
            "rel_error": float(f"{relative_error(x, y):.3g}"),
        })  # fmt: skip
    return rows


def bench_activation(repeat: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ACTIVATION_SHAPE, generator=g)
    tokens = ACTIVATION_SHAPE[0] * ACTIVATION_SHAPE[1]
    mb = 4 * x.numel() / 1e6
    rows = []
    for mode in ("fp32", "bf16", "int8", "int4"):
        codec = ActivationCodec(mode=mode)
        enc_s, frame = best_time(lambda c=codec: c.encode(x), repeat)
        dec_s, y = best_time(lambda c=codec, f=frame: c.decode(f, ACTIVATION_SHAPE), repeat)
        rows.append({
            "mode": mode,
            "encode_MBps": round(mb / enc_s, 1),
            "decode_MBps": round(mb / dec_s, 1),
            "bytes_per_token": round(len(frame) / tokens, 2),
            "ratio_vs_fp32": round(len(frame) / (4 * x.numel()), 4),
            "rel_error": float(f"{relative_error(x, y):.3g}"),
        })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True))]
    lines += [
        "  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths, strict=True)) for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--numel", type=int, default=4_000_000, help="pseudo-gradient size")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "config": {"numel": args.numel, "threads": args.threads, "repeat": args.repeat,
                   "activation_shape": list(ACTIVATION_SHAPE), "torch": torch.__version__},
        "pseudo_gradient": bench_gradient(args.numel, args.repeat),
        "activation": bench_activation(max(args.repeat, 10)),
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print(f"pseudo-gradient, {args.numel} float32 values, {args.threads} thread(s)")
        print(table(result["pseudo_gradient"]))
        print(f"\nactivation {list(ACTIVATION_SHAPE)}")
        print(table(result["activation"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
