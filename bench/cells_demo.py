"""Cells of daemons against the same swarm without them: `agora-node demo` runs, alternated.

    python bench/cells_demo.py --json [--manifest cells] [--minutes 4] [--pairs 2]

Runs `agora-node demo --manifest <manifest>` (a manifest with cp_degree > 1) and the same
manifest with cp_degree = 1, one after the other (A B A B ...), each for `--minutes`, on
the cores this machine has, and reads what the demo printed: its progress lines (tokens
the heads got back, their validation loss) and its summary (the cells' micro-batches and
K/V bytes per token). Prints one JSON line: per run, the median tok/s of the lines from
60 s on, the tokens and validation loss at the end, the validation loss last reported at
or before the cells' final token count (equal tokens), and the cells' figures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from agora_node.stages.manifest_files import load_manifest

ROW = re.compile(
    r"^\s+(\d+)s \|\s+(\d+) tok/s \| loss [\d.-]+ \| val_loss\s+([\d.-]+)\s+\| tokens (\d+)", re.M
)
CELLS = re.compile(r"(\d+) micro-batches split, (\d+) trained whole, K/V ([\d.]+) B/token")


def without_cells(manifest: str, out: Path) -> Path:
    text = load_manifest(manifest).to_toml()
    text = re.sub(r"cp_degree = \d+", "cp_degree = 1", text)
    text = re.sub(r'name = "([^"]+)"', r'name = "\1-cp1"', text, count=1)
    out.write_text(text)
    return out


def run_demo(manifest: str, minutes: float, workdir: Path) -> str:
    cmd = [sys.executable, "-m", "agora_node", "demo", "--manifest", manifest]
    cmd += ["--minutes", str(minutes), "--base-port", "0", "--data-dir", str(workdir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=minutes * 60 + 300)
    return done.stdout


def figures(output: str) -> dict:
    rows = [(int(t), int(r), v, int(n)) for t, r, v, n in ROW.findall(output)]
    late = [r for t, r, _, _ in rows if t >= 60]
    cells = CELLS.search(output)
    return {
        "tok_per_s_median": statistics.median(late) if late else None,
        "tokens": rows[-1][3] if rows else 0,
        "val_loss": float(rows[-1][2]) if rows and rows[-1][2] != "-" else None,
        "rows": [[t, n, None if v == "-" else float(v)] for t, _, v, n in rows],
        "cells": None
        if cells is None
        else {
            "split": int(cells[1]),
            "trained_whole": int(cells[2]),
            "kv_bytes_per_token": float(cells[3]),
        },
    }


def val_at(rows: list, tokens: int) -> float | None:
    """The validation loss last reported at or before `tokens`."""
    seen = [v for _, n, v in rows if n <= tokens and v is not None]
    return seen[-1] if seen else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--manifest", default="cells")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agora-cells-bench-"))
    plain = str(without_cells(args.manifest, work / "cp1.toml"))
    runs: dict[str, list[dict]] = {"cells": [], "no_cells": []}
    for i in range(args.pairs):
        for side, manifest in (("cells", args.manifest), ("no_cells", plain)):
            out = run_demo(manifest, args.minutes, work / f"{side}-{i}")
            runs[side].append(figures(out))
            if not args.json:
                print(side, i, {k: v for k, v in runs[side][-1].items() if k != "rows"})
    for cell_run, plain_run in zip(runs["cells"], runs["no_cells"], strict=True):
        plain_run["val_loss_at_cells_tokens"] = val_at(plain_run["rows"], cell_run["tokens"])
    result = {
        "manifest": args.manifest,
        "minutes": args.minutes,
        "order": "cells, no_cells, alternated",
        "runs": {
            s: [{k: v for k, v in r.items() if k != "rows"} for r in rs] for s, rs in runs.items()
        },
        "tok_per_s_ratio": statistics.median(r["tok_per_s_median"] for r in runs["cells"])
        / statistics.median(r["tok_per_s_median"] for r in runs["no_cells"]),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
