"""Serving side by side: mlx-serve against mlx_lm.server on one model, the
same requests from the same clients, one server at a time.

For each server: start it, wait for /health, warm it with one request (MLX
compiles kernels the first time it meets a shape), then for each number of
concurrent clients send streamed chat completions and measure aggregate
generated tokens/s, time to first token (p50, p99) and, at the end, the
server's peak RSS (VmHWM). Two shapes: classification (a shared system
prompt of about 600 tokens, a short user turn, one token out) and chat (a
short prompt, --chat-tokens out). Tokens are counted the same way for both
servers: streamed chunks with content.

Usage (what `cargo xtask bench serve` runs):
  serve.py --model-dir DIR --mlx-serve BIN [--mlx-lm-python PY] [--clients 1,2,8,32]
           [--chat-clients 1,2,8] [--chat-tokens 32] [--json OUT]
"""

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

SYSTEM = (
    "You rate customer reviews of kitchen appliances. Read the review, weigh what the customer "
    "praises against what they complain about, and answer with one digit from 1 (very bad) to 5 "
    "(very good), nothing else. "
) + " ".join(
    f"Rule {i}: a review that mentions {topic} should be judged on the product, not on delivery, "
    "price or the seller's manners, unless the customer says these made the product worse."
    for i, topic in enumerate(
        ["noise", "power", "cleaning", "size", "lids", "blades", "warranty", "colour", "cables",
         "smell", "speed", "buttons", "manuals", "heat", "weight", "storage", "jars", "timers"]
    )
)

REVIEWS = [
    "Crushed ice in seconds.", "Broke after two days.", "Fine, nothing special.",
    "Loud but strong.", "The lid leaks.", "Best purchase this year.", "Too heavy to move.",
    "Cleaning it is a chore.", "Works as described.", "Smells of burnt plastic.",
    "Quiet and fast.", "Buttons stopped working.", "Great value.", "Jar cracked.",
    "My kids love the smoothies.", "Returned it.",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port, proc, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before answering")
        for path in ("/health", "/v1/models"):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", path)
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
        time.sleep(0.5)
    raise RuntimeError("the server did not answer /health in time")


def stream_request(port, model, messages, max_tokens):
    """One streamed completion: (time to first token, tokens, seconds)."""
    body = json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    })
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read()[:300]!r}")
    first, tokens, prompt = None, 0, None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            prompt = chunk["usage"].get("prompt_tokens")
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                tokens += 1
                if first is None:
                    first = time.perf_counter() - start
    conn.close()
    return first if first is not None else time.perf_counter() - start, tokens, prompt


def level(port, model, clients, requests, make_messages, max_tokens):
    results, errors = [], []
    lock = threading.Lock()
    counter = iter(range(requests))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                r = stream_request(port, model, make_messages(i), max_tokens)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)

    def pct(p):
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else float("nan")

    if errors:
        print(f"  {len(errors)} errors, the first: {errors[0]}", file=sys.stderr)
    prompts = [r[2] for r in results if r[2] is not None]
    return {
        "clients": clients, "requests": requests, "errors": len(errors),
        "prompt_tokens": statistics.median(prompts) if prompts else None,
        "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
        "ttft_p50": statistics.median(ttfts) if ttfts else float("nan"), "ttft_p99": pct(0.99),
    }


def peak_rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_server(name, cmd, port, model, args, env=None):
    print(f"== {name}: {' '.join(cmd)}", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    rows = []
    try:
        wait_healthy(port, proc)
        classify = lambda i: [  # noqa: E731
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": REVIEWS[i % len(REVIEWS)]},
        ]
        chat = lambda i: [  # noqa: E731
            {"role": "user", "content": f"Tell me about {['tea', 'rivers', 'cats', 'bread'][i % 4]}."},
        ]
        stream_request(port, model, classify(0), 1)
        stream_request(port, model, chat(0), 4)
        for clients in args.clients:
            requests = max(clients, args.min_requests)
            row = level(port, model, clients, requests, classify, 1)
            row.update(server=name, shape="classification")
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        for clients in args.chat_clients:
            row = level(port, model, clients, clients, chat, args.chat_tokens)
            row.update(server=name, shape=f"chat ({args.chat_tokens} tokens)")
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        peak = peak_rss_mb(proc.pid)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/metrics")
            metrics = conn.getresponse()
            if metrics.status == 200:
                for line in metrics.read().decode().splitlines():
                    if line.startswith("mlx_serve_prefix_cache"):
                        print(f"  {line}", file=sys.stderr)
        except OSError:
            pass
        for row in rows:
            row["peak_rss_mb"] = peak
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--mlx-serve", required=True)
    p.add_argument("--mlx-serve-args", default="",
                   help="more arguments for mlx-serve, e.g. '--admission-window-ms 0'")
    p.add_argument("--mlx-lm-python")
    p.add_argument("--mlx-lm-path", help="a folder put first on mlx_lm.server's PYTHONPATH "
                   "(the interop venv keeps mlx_lm 0.32.2 in one)")
    p.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python[server]")
    p.add_argument("--gguf", help="the same model as GGUF, for llama.cpp's server")
    p.add_argument("--clients", default="1,2,8,32")
    p.add_argument("--chat-clients", default="1,2,8")
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json")
    args = p.parse_args()
    args.clients = [int(c) for c in args.clients.split(",") if c]
    args.chat_clients = [int(c) for c in args.chat_clients.split(",") if c]
    rows = []
    port = free_port()
    rows += run_server(
        "mlx-serve",
        [args.mlx_serve, "--model-dir", args.model_dir, "--model-id", "bench", "--port", str(port),
         "--batch-size", str(args.batch_size), "--max-queue", "1024", *args.mlx_serve_args.split()],
        port, "bench", args,
    )
    if args.mlx_lm_python:
        port = free_port()
        env_cmd = [args.mlx_lm_python, "-m", "mlx_lm.server", "--model", args.model_dir,
                   "--host", "127.0.0.1", "--port", str(port)]
        env = dict(os.environ)
        if args.mlx_lm_path:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in [args.mlx_lm_path, env.get("PYTHONPATH")] if p)
        version = subprocess.run(
            [args.mlx_lm_python, "-c", "import mlx_lm, mlx.core; print(mlx_lm.__version__, mlx.core.__version__)"],
            env=env, capture_output=True, text=True).stdout.strip()
        print(f"mlx_lm, mlx: {version}", file=sys.stderr)
        rows += run_server(f"mlx_lm.server", env_cmd, port, args.model_dir, args, env)
    if args.llama_cpp_python and args.gguf:
        port = free_port()
        cmd = [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", args.gguf,
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096",
               "--model_alias", "bench"]
        rows += run_server("llama.cpp", cmd, port, "bench", args)
    print(f"{'server':<14} {'shape':<22} {'clients':>7} {'tok/s':>8} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'errors':>6} {'peak RSS':>9}")
    for r in rows:
        print(f"{r['server']:<14} {r['shape']:<22} {r['clients']:>7} {r['tokens_per_s']:>8.2f} "
              f"{r['ttft_p50']:>8.2f}s {r['ttft_p99']:>8.2f}s {r['errors']:>6} "
              f"{r['peak_rss_mb']:>6.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
