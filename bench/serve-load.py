#!/usr/bin/env python3
"""Load test for `kiln serve`: concurrent streaming clients over plain HTTP (standard library only).

Starts `kiln serve` on a free port (or uses --url), then:
  1. alternates 1 stream and 8 concurrent streams (--rounds times) and reports the median
     aggregate generated tokens/s of each and their ratio;
  2. runs --clients concurrent streaming clients x --tokens tokens and checks that every request
     completes (none lost, no error), reporting aggregate tokens/s and p50/p99 time to first token.

Example:
  cargo build --release -p kiln
  python3 bench/serve-load.py --kiln target/release/kiln --threads 2
"""

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain how a steam engine works, step by step.",
    "List the planets of the solar system and describe each one.",
    "Describe a walk through a busy market in a large city.",
    "Tell me about the history of the printing press.",
    "What makes a good cup of coffee? Explain in detail.",
    "Write a letter to a friend about a trip to the mountains.",
    "Describe the life cycle of a butterfly.",
]


def stream_one(host, port, i, tokens, sampling, results):
    """One streaming completion; appends a result dict (or an error) to `results`."""
    body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "stream": True, **sampling})
    t0 = time.perf_counter()
    ttft = None
    usage = None
    done = False
    try:
        conn = http.client.HTTPConnection(host, port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            results.append({"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"})
            return
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                results.append({"error": chunk["error"]["message"]})
                return
            if ttft is None and chunk["choices"] and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
        conn.close()
    except Exception as e:  # noqa: BLE001 - any failure is a lost request
        results.append({"error": repr(e)})
        return
    if not done or usage is None:
        results.append({"error": "stream ended without [DONE] and usage"})
        return
    results.append({"ttft": ttft, "tokens": usage["completion_tokens"], "secs": time.perf_counter() - t0})


def run_wave(host, port, clients, tokens, sampling):
    """`clients` concurrent streams (`sampling`: the requests' sampling fields); returns (results, wall seconds)."""
    results = []
    threads = [
        threading.Thread(target=stream_one, args=(host, port, i, tokens, sampling, results)) for i in range(clients)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default="target/release/kiln", help="kiln binary (started with `serve`)")
    ap.add_argument("--url", help="use a running server instead of starting one")
    ap.add_argument("--model", help="GGUF file (default: the default model)")
    ap.add_argument("--threads", type=int, default=0, help="--threads for kiln serve (0: all cores)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="alternating 1-stream / 8-stream rounds")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="each request's temperature (0: greedy; above 0 the server's other sampling defaults)")
    ap.add_argument("--top-k", type=int, default=0, help="each request's top_k (0: not sent)")
    ap.add_argument("--device", help="--device for kiln serve (e.g. cuda)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    sampling = {"temperature": args.temperature, **({"top_k": args.top_k} if args.top_k else {})}

    server = None
    if args.url:
        u = urllib.parse.urlparse(args.url)
        host, port = u.hostname, u.port
    else:
        host, port = "127.0.0.1", free_port()
        cmd = [args.kiln, "serve", "--port", str(port), "--parallel", str(max(32, args.clients)),
               "--queue", str(2 * args.clients), "--threads", str(args.threads)]
        if args.model:
            cmd += ["--model", args.model]
        if args.device:
            cmd += ["--device", args.device]
        server = subprocess.Popen(cmd)
    try:
        for _ in range(600):
            try:
                c = http.client.HTTPConnection(host, port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        else:
            sys.exit("the server did not come up")
        # Warm-up: compiles the plans the waves use.
        run_wave(host, port, 1, 8, sampling)
        run_wave(host, port, 8, 8, sampling)

        rates = {1: [], 8: []}
        for r in range(args.rounds):
            for n in (1, 8):
                res, wall = run_wave(host, port, n, args.tokens, sampling)
                errors = [x["error"] for x in res if "error" in x]
                if errors:
                    sys.exit(f"{n}-stream wave failed: {errors[:3]}")
                rates[n].append(sum(x["tokens"] for x in res) / wall)
                print(f"round {r + 1}: {n} stream(s): {rates[n][-1]:.1f} tok/s aggregate", flush=True)
        one, eight = statistics.median(rates[1]), statistics.median(rates[8])

        res, wall = run_wave(host, port, args.clients, args.tokens, sampling)
        ok = [x for x in res if "error" not in x]
        errors = [x["error"] for x in res if "error" in x]
        ttfts = [x["ttft"] for x in ok if x["ttft"] is not None]
        summary = {
            "single_stream_tok_s": round(one, 2),
            "eight_streams_tok_s": round(eight, 2),
            "eight_vs_one": round(eight / one, 2),
            "clients": args.clients,
            "completed": len(ok),
            "lost": args.clients - len(ok),
            "errors": errors[:5],
            "tokens_per_request": args.tokens,
            "sampling": sampling,
            "generated_tokens": sum(x["tokens"] for x in ok),
            "aggregate_tok_s": round(sum(x["tokens"] for x in ok) / wall, 2),
            "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 3) if ttfts else None,
            "wall_s": round(wall, 2),
        }
        print(json.dumps(summary, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        if summary["lost"]:
            sys.exit(f"{summary['lost']} of {args.clients} requests were lost: {errors[:3]}")
    finally:
        if server:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
