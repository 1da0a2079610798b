"""Serving benchmark: throughput and latency of an OpenAI-compatible server under concurrent streams.

    python3 bench/serve_bench.py                                  # starts `mlxinfer serve` (default model, cpu) itself
    python3 bench/serve_bench.py --backend mlx --concurrency 1,8,32 --requests 64
    python3 bench/serve_bench.py --url http://127.0.0.1:8080/v1 --model-id NAME   # any running server (a peer)

For each concurrency C, C clients (asyncio, the `openai` client, streaming chat completions at temperature
0) send --requests requests in all, each with a prompt of --prompt-words words and --max-tokens tokens,
and the bench records per request the time to first token (request sent -> first content chunk) and the
intervals between content chunks (inter-token latency), and overall the generated tokens per second
(completion tokens from `usage` / wall time of the level). Prints a JSON line per level (also to --out)
and a Markdown table: throughput, TTFT p50/p99, ITL p50/p99. Bounded: every level stops at --timeout s.
"""

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time


def bench_prompt(words: int = 64) -> str:
    """The prompt every request sends: `words` words of a repeated sentence, then an instruction."""
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * (words // 9 + 1)).split()
    return " ".join(prompt[:words]) + ". Continue the story."


def percentile(values, p):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


async def one_request(client, model_id, prompt, max_tokens):
    t0 = time.perf_counter()
    first, last, intervals, tokens, chunks = None, None, [], None, 0
    stream = await client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                intervals.append(now - last)
            last = now
    # a server that sends no usage when streaming (llama-cpp-python's): one content chunk per token
    return dict(ttft=None if first is None else first - t0, intervals=intervals,
                tokens=chunks if tokens is None else tokens, counted=tokens is None)


async def level(url, model_id, concurrency, n_requests, prompt, max_tokens, timeout):
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout)
    queue = list(range(n_requests))
    results = []

    async def worker():
        while queue:
            queue.pop()
            results.append(await one_request(client, model_id, prompt, max_tokens))

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(concurrency)]), timeout)
    wall = time.perf_counter() - t0
    await client.close()
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [x for r in results for x in r["intervals"]]
    tokens = sum(r["tokens"] for r in results)
    counted = any(r["counted"] for r in results)
    return dict(concurrency=concurrency, requests=len(results), completion_tokens=tokens, wall_s=wall,
                ttft_ms_each=[round(1000 * t, 1) for t in ttft],
                tokens_per_second=tokens / wall, tokens_from="content chunks" if counted else "usage", ttft_p50_ms=1000 * percentile(ttft, 50),
                ttft_p99_ms=1000 * percentile(ttft, 99), itl_p50_ms=1000 * percentile(itl, 50) if itl else None,
                itl_p99_ms=1000 * percentile(itl, 99) if itl else None)


def start_server(args, port):
    cmd = [sys.executable, "-m", "mlxinfer", "serve", "--port", str(port), "--backend", args.backend,
           "--max-batch", str(args.max_batch), "--max-queue", str(max(64, args.requests)), "--kv", args.kv]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import httpx

    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().strip()}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            if r.status_code == 200:
                return proc, r.json()["data"][0]["id"]
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("server did not start within 600 s")
        time.sleep(0.2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server's /v1 URL (default: start mlxinfer serve)")
    p.add_argument("--model-id", default=None, help="model id to ask the --url server for (default: its first)")
    p.add_argument("--model", default=None, help="GGUF for the server this bench starts (default: the default model)")
    p.add_argument("--backend", default="cpu", help="backend of the server this bench starts (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=32, help="its --max-batch (default: %(default)s)")
    p.add_argument("--kv", default="paged", help="its --kv cache (default: %(default)s)")
    p.add_argument("--port", type=int, default=8791, help="its port (default: %(default)s)")
    p.add_argument("--concurrency", default="1,8,32", help="concurrent clients per level (default: %(default)s)")
    p.add_argument("--requests", type=int, default=32, help="requests per level (default: %(default)s)")
    p.add_argument("--prompt-words", type=int, default=64, help="words in each prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600, help="seconds each level may take (default: %(default)s)")
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args(argv)
    proc = None
    if args.url is None:
        proc, model_id = start_server(args, args.port)
        url, engine = f"http://127.0.0.1:{args.port}/v1", f"mlxinfer {args.backend} ({args.kv})"
    else:
        import httpx

        url, engine = args.url, "peer"
        model_id = args.model_id or httpx.get(url + "/models", timeout=10).json()["data"][0]["id"]
    prompt = bench_prompt(args.prompt_words)
    header = dict(kind="header", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  machine=f"{platform.platform()}, {os.cpu_count()} cpus", url=url, model=model_id, engine=engine,
                  command="python3 bench/serve_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(json.dumps(header))
    rows = []
    try:
        asyncio.run(level(url, model_id, 1, 1, prompt, 4, args.timeout))  # warm-up
        for c in [int(x) for x in args.concurrency.split(",")]:
            row = dict(engine=engine, model=model_id, max_tokens=args.max_tokens, prompt_words=args.prompt_words,
                       **asyncio.run(level(url, model_id, c, args.requests, prompt, args.max_tokens, args.timeout)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if args.out:
        with open(args.out, "a") as f:
            for r in [header, *rows]:
                f.write(json.dumps(r) + "\n")
    print("\n| engine | concurrency | requests | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        print(f"| {r['engine']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_second']:.1f} | "
              f"{fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} | {fmt(r['itl_p50_ms'])} | {fmt(r['itl_p99_ms'])} |")


if __name__ == "__main__":
    main()
