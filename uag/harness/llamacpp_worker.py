"""llama.cpp's side of ``python -m uag.harness.llamacpp``: run as a script by an interpreter that
has ``llama-cpp-python`` (uag need not be installed there: stdlib and ``llama_cpp`` only).

It loads the GGUF twice (target alone; prompt lookup through ``LlamaPromptLookupDecoding``),
prints ``{"ready": true}``, then answers one JSON request per line on stdin
(``{"ids": [...], "arm": "target-only" | "lookup", "max_new_tokens": n, "stop": [...]}``) with
``{"ids": [...], "seconds": s}``: greedy tokens after the given prompt ids, timed from the call
to the last token (prompt evaluation included, as uag's arms are timed), stopping before a
``stop`` id (uag's own stop ids for the target) or at ``max_new_tokens``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def load(draft: object) -> Llama:
        return Llama(
            model_path=args.gguf,
            n_ctx=args.context,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            n_batch=512,
            draft_model=draft,
            logits_all=draft is not None,
            verbose=False,
        )

    models = {
        "target-only": load(None),
        "lookup": load(LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens)),
    }
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llm = models[request["arm"]]
        limit, stop = int(request["max_new_tokens"]), set(request["stop"])
        out: list[int] = []
        start = time.perf_counter()
        for token in llm.generate(
            request["ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            if token in stop:
                break
            out.append(int(token))
            if len(out) >= limit:
                break
        seconds = time.perf_counter() - start
        print(json.dumps({"ids": out, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
