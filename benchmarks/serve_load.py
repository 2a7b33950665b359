"""Load test of `speccomp serve` on loopback: concurrent streaming clients, bounded, stops by itself.

    python benchmarks/serve_load.py                    # SmolLM2 + token_recycling exported to a temporary engine
    python benchmarks/serve_load.py --engine DIR --requests 16 --concurrency 8 --max-tokens 64

1. Each prompt's HF greedy reply (the reference) and, for the same prompts one after another, HF's plain
   `generate` time, before the server starts (nothing else runs meanwhile).
2. `speccomp serve ENGINE --max-batch C` in a child process on a free loopback port (2 ONNX Runtime threads).
3. R chat requests (temperature 0, "stream": true) from C concurrent clients (asyncio + httpx), each with a deadline;
   per request the time to its first token and to its last, and whether its token ids equal the reference.
4. The server's /metrics, then the server is stopped.

Prompts: the held-out sets (gsm8k, vicuna_bench) round robin. Writes a table to stdout and everything to --json
(default benchmarks/results_serve_load.json). Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def reference(args) -> tuple[list[str], list[list[int]], float]:
    """Prompts, their HF greedy replies (up to and including eos) and HF's seconds for all of them, one by one."""
    import torch

    import speccomp
    from speccomp.models import chat_ids
    from speccomp.prompts import HELD_OUT_SETS, load_prompts

    torch.set_num_threads(2)
    model, tok = speccomp.load_default_model()
    sets = [load_prompts(name) for name in HELD_OUT_SETS]
    texts = [sets[i % len(sets)][i // len(sets)].text for i in range(args.requests)]
    replies, start = [], time.perf_counter()
    for text in texts:
        ids = chat_ids(tok, text)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.max_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        new = out[0, ids.shape[1]:].tolist()
        replies.append(new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new)
    hf_seconds = time.perf_counter() - start
    if args.engine is None:
        args.engine = str(Path(args.tmp) / "engine")
        speccomp.compile(model, drafter=args.drafter, backend="onnxruntime").export(args.engine, tokenizer=tok)
    return texts, replies, hf_seconds


async def client(url: str, text: str, max_tokens: int, deadline: float) -> dict:
    import httpx

    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    start, first, ids, server = time.perf_counter(), None, [], None
    try:
        async with httpx.AsyncClient(timeout=deadline) as http:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return {"status": r.status_code, "error": (await r.aread()).decode()[:200]}
                server = r.headers.get("x-speccomp-server")  # which process (replica) answered
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"status": 500, "error": chunk["error"]["message"]}
                    got = chunk["choices"][0].get("token_ids", [])
                    if got and first is None:
                        first = time.perf_counter() - start
                    ids += got
    except httpx.HTTPError as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"status": 200, "ttft": first, "latency": time.perf_counter() - start, "ids": ids, "server": server}


async def load(url: str, texts: list[str], args) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(args.concurrency)

    async def one(text):
        async with gate:
            return await client(url, text, args.max_tokens, args.deadline)

    start = time.perf_counter()
    results = await asyncio.wait_for(asyncio.gather(*(one(t) for t in texts)), timeout=args.deadline * len(texts))
    return results, time.perf_counter() - start


def main(argv=None) -> int:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=None, help="engine directory (default: export SmolLM2 + --drafter)")
    parser.add_argument("--drafter", default="token_recycling")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--replicas", type=int, default=None, help="serve through N Ray Serve replicas "
                        "(speccomp serve --replicas N; the 2 ONNX Runtime threads split between them)")
    parser.add_argument("--json", default=str(HERE / "results_serve_load.json"))
    args = parser.parse_args(argv)
    if args.replicas is not None and args.replicas < 1:
        parser.error(f"--replicas {args.replicas}: must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        texts, replies, hf_seconds = reference(args)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "speccomp.cli", "serve", args.engine, "--port", str(port),
                   "--max-batch", str(args.concurrency), "--threads", str(2 // (args.replicas or 1) or 1)]
        if args.replicas:
            command += ["--replicas", str(args.replicas)]
        server = subprocess.Popen(command)
        try:
            for _ in range(900):  # up to 3 minutes: Ray starts a cluster and loads each replica's engine
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            results, wall = asyncio.run(load(url, texts, args))
            metrics = httpx.get(f"{url}/metrics").text
        finally:
            server.terminate()  # SIGTERM: uvicorn stops; with --replicas, Ray Serve's shutdown stops the replicas
            server.wait(timeout=60)
    ok = [r for r in results if r["status"] == 200]
    equal = sum(r["ids"] == want for r, want in zip(results, replies) if r["status"] == 200)
    latencies = sorted(r["latency"] for r in ok)
    tokens = sum(len(r["ids"]) for r in ok)
    summary = {"requests": len(texts), "answered": len(ok), "refused_or_failed": len(texts) - len(ok),
               "equal_to_hf_greedy": equal, "wall_seconds": wall, "tokens": tokens, "tokens_per_second": tokens / wall,
               "hf_sequential_tokens_per_second": sum(map(len, replies)) / hf_seconds,
               "p50_latency": statistics.median(latencies) if latencies else None,
               "p99_latency": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
               "p50_ttft": statistics.median(r["ttft"] for r in ok if r["ttft"] is not None) if ok else None,
               "replicas_answering": len({r["server"] for r in ok})}
    print(f"\nspeccomp serve, {args.requests} requests, {args.concurrency} concurrent clients, {args.max_tokens} max "
          f"tokens, drafter {args.drafter}, {args.replicas or 1} replica(s)")
    for key, value in summary.items():
        print(f"  {key:32} {value:.3f}" if isinstance(value, float) else f"  {key:32} {value}")
    for r in results:
        if r["status"] != 200:
            print(f"  failed: {r}")
    Path(args.json).write_text(json.dumps({
        "command": "python benchmarks/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpus": os.cpu_count(), "args": {k: v for k, v in vars(args).items() if k != "tmp"}, "summary": summary,
        "requests": [{k: v for k, v in r.items() if k != "ids"} | {"tokens": len(r.get("ids", []))} for r in results],
        "metrics": metrics}, indent=1))
    return 0 if len(ok) == len(texts) and equal == len(texts) else 1


if __name__ == "__main__":
    sys.exit(main())
