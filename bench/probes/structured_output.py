"""Do schema-constrained answers all validate under load, and what does the mask cost in total tokens/s?

Starts `mlxinfer serve`'s app in this process (uvicorn on 127.0.0.1, a free port, --max-batch 32), then
sends 100 chat requests from 32 concurrent clients (the openai SDK's async client), each with a
`response_format` JSON schema at temperature 0.8 (seed = request number), and checks every answer with
`jsonschema`; then --baseline-requests (50) of the same requests without the schema, each with max_tokens
the schema answers' mean length (so both phases decode answers of about the same length: a free answer
would otherwise run to max_tokens, and a batch's speed depends on its sequences' lengths). Prints one
JSON line per phase: requests, valid answers, finish reasons, completion tokens, wall seconds and total
completion tokens/s. Bounded: a phase stops sending after --seconds.

    PYTHONPATH=$PWD python3 bench/probes/structured_output.py [-m MODEL] [--backend cpu] [--out rows.jsonl]

Reaches into: `mlxinfer.server.create_app` and uvicorn's `Server` (started in a thread).
"""

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

import jsonschema
import uvicorn
from openai import AsyncOpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # jsonl.py beside this file
from jsonl import emit  # noqa: E402

import mlxinfer  # noqa: E402
from mlxinfer.server import create_app  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colour": {"enum": ["red", "green", "blue"]},
}, "required": ["name", "age", "colour"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
ASK = "Invent a person: their name, age and favourite colour, as JSON."


async def phase(url: str, model: str, n: int, clients: int, max_tokens: int, schema: bool, seconds: float) -> dict:
    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    queue, results = asyncio.Queue(), []
    for i in range(n):
        queue.put_nowait(i)
    deadline = time.monotonic() + seconds

    async def worker():
        while not queue.empty() and time.monotonic() < deadline:
            i = queue.get_nowait()
            extra = {"response_format": FORMAT} if schema else {}
            r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": ASK}],
                                                     temperature=0.8, seed=i, max_tokens=max_tokens, **extra)
            text = r.choices[0].message.content
            valid = None
            if schema:
                try:
                    jsonschema.validate(json.loads(text), SCHEMA)
                    valid = True
                except (ValueError, jsonschema.ValidationError):
                    valid = False
            results.append((r.choices[0].finish_reason, r.usage.completion_tokens, valid))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    tokens = sum(t for _, t, _ in results)
    reasons = {}
    for f, _, _ in results:
        reasons[f] = reasons.get(f, 0) + 1
    return dict(schema=schema, requests=len(results), valid=sum(1 for *_, v in results if v) if schema else None,
                finish_reasons=reasons, completion_tokens=tokens, wall_s=round(wall, 2),
                tokens_per_s=round(tokens / wall, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("-n", "--requests", type=int, default=100)
    ap.add_argument("--baseline-requests", type=int, default=50)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=110.0, help="per phase: no request sent after this")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    engine = mlxinfer.load(a.model, backend=a.backend, kv="paged")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(engine, "probe", max_batch=a.clients, max_queue=4 * a.requests)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    try:
        url, max_tokens = f"http://127.0.0.1:{port}/v1", a.max_tokens
        for schema, n in ((True, a.requests), (False, a.baseline_requests)):
            row = asyncio.run(phase(url, "probe", n, a.clients, max_tokens, schema, a.seconds))
            emit(dict(probe="structured_output", model=os.path.basename(engine.path), backend=engine.backend.describe(),
                      clients=a.clients, max_tokens=max_tokens, temperature=0.8, **row), a.out)
            max_tokens = max(1, round(row["completion_tokens"] / max(1, row["requests"])))
    finally:
        server.should_exit = True


if __name__ == "__main__":
    main()
