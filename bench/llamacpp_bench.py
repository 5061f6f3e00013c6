"""One llama.cpp measurement through llama-cpp-python, as `kiln bench` measures kiln.

pp N: N prompt tokens evaluated in one call from an empty cache; tg N: N greedy decode steps
(eval one token, argmax of its logits) from an empty cache. One warm-up run of each test, then
`--reps` timed runs. Prints one JSON record per test with llama-bench's field names.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
from llama_cpp import Llama


def prompt_tokens(n, vocab):
    # The same deterministic tokens kiln bench uses.
    span = max(vocab - 1000, 1)
    return [min(1000 + (i * 7919 + 13) % span, vocab - 1) for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=1)
    a = ap.parse_args()

    llm = Llama(
        model_path=a.model,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_ctx=max(a.n_prompt, a.n_gen) + 16,
        n_batch=512,
        verbose=False,
    )
    vocab = llm.n_vocab()

    def pp(n):
        llm.reset()
        toks = prompt_tokens(n, vocab)
        t0 = time.perf_counter_ns()
        llm.eval(toks)
        return time.perf_counter_ns() - t0

    def tg(n):
        llm.reset()
        tok = llm.token_bos()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return time.perf_counter_ns() - t0

    records = []
    for kind, n, fn in (("pp", a.n_prompt, pp), ("tg", a.n_gen, tg)):
        if n <= 0:
            continue
        fn(n)  # warm-up
        ns = [fn(n) for _ in range(a.reps)]
        ts = [n * 1e9 / x for x in ns]
        records.append({
            "model_filename": a.model,
            "model_size": os.path.getsize(a.model),
            "n_threads": a.threads,
            "n_batch": 512,
            "n_prompt": n if kind == "pp" else 0,
            "n_gen": n if kind == "tg" else 0,
            "test_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "avg_ns": int(statistics.mean(ns)),
            "stddev_ns": int(statistics.stdev(ns)) if len(ns) > 1 else 0,
            "avg_ts": statistics.mean(ts),
            "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0,
            "samples_ns": ns,
            "samples_ts": ts,
        })
    print(json.dumps(records))


if __name__ == "__main__":
    main()
