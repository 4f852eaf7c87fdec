"""Synthetic collect runs: known structure, written with the collector's own writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from uag.decoding.features import FEATURE_NAMES, SCHEMA_VERSION
from uag.harness.collect import ITERATION_COLUMNS, part_path, write_part

PROFILE = {
    "device": "cpu:test:2threads",
    "draft_s": 0.03,
    "verify_s": [0.08, 0.1, 0.12, 0.14, 0.16, 0.18, 0.2, 0.22],
}


def write_run(
    out: Path,
    *,
    prompts: int = 12,
    lookahead: int = 5,
    seed: int = 0,
    single_class: bool = False,
    feature_names: tuple[str, ...] = FEATURE_NAMES,
) -> Path:
    """Iterations whose labels follow min_prob > 0.35 exactly (a draft survives while confident)."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    for p in range(prompts):
        keys = dict.fromkeys(
            [
                *feature_names,
                "accepted",
                "prompt_id",
                "iteration",
                "position",
                "token_id",
                *ITERATION_COLUMNS,
            ]
        )
        cols: dict[str, list] = {n: [] for n in keys}
        for it in range(20):
            probs = rng.uniform(0, 1, lookahead)
            ok = probs > 0.35 if not single_class else np.ones(lookahead, bool)
            accepted = int(np.argmin(ok)) if not ok.all() else lookahead
            for pos in range(1, lookahead + 1):
                row = {n: float(rng.normal()) for n in feature_names}
                row.update(
                    position=pos,
                    prob=probs[pos - 1],
                    min_prob=probs[:pos].min(),
                    target_tokens=pos,
                    entropy=1 - probs[pos - 1],
                )
                row.update(
                    accepted=int(pos <= accepted), prompt_id=f"p{p}", iteration=it, token_id=7
                )
                row.update(
                    zip(
                        ITERATION_COLUMNS,
                        (lookahead, lookahead, accepted, accepted + 1, accepted, 0.1, 0.1),
                        strict=True,
                    )
                )
                for n in keys:
                    cols[n].append(row[n])
        arrays = {
            k: np.asarray(v, dtype=np.float32 if k in feature_names else None)
            for k, v in cols.items()
        }
        arrays["accepted"] = arrays["accepted"].astype(np.int8)
        arrays["prompt_id"] = arrays["prompt_id"].astype(object)
        write_part(part_path(out, f"p{p}"), arrays)
    meta = {
        "schema_version": SCHEMA_VERSION,
        "feature_names": list(feature_names),
        "target": "t",
        "assistant": "a",
        "assistant_int8": False,
        "latency_profile": PROFILE,
    }
    (out / "meta.json").write_text(json.dumps(meta))
    return out
