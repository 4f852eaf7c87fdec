"""One build's side of ``python -m scripts.ab``: run as a script with that build's tree first
on ``PYTHONPATH``; it loads the pair and the bench arms once, then answers one JSON request per
line on stdin (``{"prompt": i, "arm": name}``) with ``{"ids": [...], "seconds": s}``.

It imports whatever ``uag`` the path gives, so it also reads builds from before the package
floors (``uag.bench`` rather than ``uag.harness.bench``): that is what an A/B against an older
commit needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--policies", required=True)
    parser.add_argument("--controller", default="exports/ctrl.onnx")
    args = parser.parse_args()
    try:
        from uag.harness import bench
        from uag.harness.prompts import load_prompts
        from uag.recipes import lookup_lengths
    except ImportError:  # a build from before the floors
        from uag import bench  # type: ignore[attr-defined,no-redef]
        from uag.calibration import lookup_lengths  # type: ignore[import-not-found,no-redef]
        from uag.prompts import load_prompts  # type: ignore[import-not-found,no-redef]
    names = args.policies.split(",")
    cfg = bench.BenchConfig(
        prompts=args.prompts,
        out=Path("unused"),
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        assistant_int8=True,
        controller=Path(args.controller),
        policies=args.policies,
        progress=False,
    )
    prompts = load_prompts(cfg.prompts, text_column=cfg.text_column, limit=cfg.limit)
    pair = cfg.load_pair()
    lengths = lookup_lengths(pair, quiet=True) if any("lookup" in n for n in names) else None
    arms = bench.build_arms(
        names, pair, cfg, prompt_ids=[p.id for p in prompts], lookup_lengths=lengths
    )
    for arm in arms.values():  # warm-up, as bench does
        arm(prompts[0].text, 4, None)
    print(json.dumps({"ready": len(prompts)}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        run = arms[request["arm"]](prompts[request["prompt"]].text, cfg.max_new_tokens, None)
        print(json.dumps({"ids": run.ids, "seconds": run.seconds}), flush=True)


if __name__ == "__main__":
    main()
