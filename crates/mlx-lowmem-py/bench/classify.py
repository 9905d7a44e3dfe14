"""cc-sentiment's classification through our Python face and through the
Python original, side by side in one run (each configuration in a fresh
process, the two sides alternating).

Usage: classify.py MODEL_DIR [--batches 2,8] [--texts 32] [--rounds 1]

Each run is cc-sentiment 0.2.135's own `SentimentClassifier(model_dir)` with
its prompt (`build_prefix_messages()`), one user message per text
(`build_user_content`), `score_messages` and `extract_score`; the batch size
is the classifier's class attribute, set as a subclass would. "ours":
`spawnllm.mlx` aliased to `mlx_lowmem` (its defaults: mlx_lm's arithmetic,
the original's prefix cache; `MLX_LOWMEM_QUANTIZED` passes through);
"original": spawnllm 0.17.1's `MlxEngine` on mlx-lm (0.31.3 in the face
venv), its macOS checks answered as on a Mac. Reported per run: load seconds
(model + prefix), conversations per second while scoring, the process's
peak RSS (VmHWM), the labels (the two sides must agree).

Needs the face venv (`cargo xtask python-face`); `cargo xtask bench
python-face` runs it on the SmolLM2-135M fixture (f32).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARITY = HERE.parents[1] / "mlx-engine" / "tests" / "parity"

# The sixteen developer messages the label tests use (kept with their labels).
TEXTS = json.loads((HERE.parents[1] / "mlx-engine/tests/data/cc_sentiment_original.json").read_text())["inputs"]["texts"]

CHILD = r"""
import asyncio, json, sys, time
side, model_dir, batch, texts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
sys.path.insert(0, sys.argv[5])
if side == "ours":
    import spawnllm, mlx_lowmem
    sys.modules["spawnllm.mlx"] = mlx_lowmem
    spawnllm.mlx = mlx_lowmem
import spawnllm.mlx, cc_sentiment.adapter, cc_sentiment.engines.base
from cc_sentiment.text import build_prefix_messages, build_user_content, extract_score
from apple_platform import ApplePlatform

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

async def main():
    with ApplePlatform():
        from cc_sentiment.sentiment import SentimentClassifier
        SentimentClassifier.BATCH_SIZE = batch
        clock = time.perf_counter()
        classifier = SentimentClassifier(model_dir)
    await classifier.ensure_loaded()
    load_s = time.perf_counter() - clock
    conversations = [[*build_prefix_messages(), {"role": "user", "content": build_user_content(t)}] for t in texts]
    clock = time.perf_counter()
    answers = await classifier.score_messages(conversations, lambda n: None)
    score_s = time.perf_counter() - clock
    await classifier.close()
    print(json.dumps({"load_s": load_s, "conv_per_s": len(texts) / score_s, "peak_rss_mb": peak_rss() / 2**20,
                      "labels": [str(int(extract_score(a))) for a in answers]}))

asyncio.run(main())
"""


def run(side: str, model: str, batch: int, texts: list[str], env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, side, model, str(batch), json.dumps(texts), str(PARITY)],
        capture_output=True, text=True, env={**os.environ, **(env or {})},
    )
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise SystemExit(f"{side} batch {batch} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1])
    if done.returncode != 0:
        # It answered, then died on the way out (seen with the original's
        # daemon worker thread still holding MLX at interpreter exit).
        print(f"note: {side} batch {batch} exited with {done.returncode} after answering: "
              f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batches", default="2,8")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    texts = [TEXTS[i % len(TEXTS)] for i in range(args.texts)]
    print(f"model: {args.model}; {len(texts)} conversations; cc-sentiment's prompt")
    print("| batch | side | load s | conv/s | peak RSS MB | labels equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in [int(b) for b in args.batches.split(",")]:
        for _ in range(args.rounds):
            ours = run("ours", args.model, batch, texts)
            original = run("original", args.model, batch, texts)
            same = ours["labels"] == original["labels"]
            for side, r in [("mlx_lowmem", ours), ("spawnllm + mlx_lm", original)]:
                print(f"| {batch} | {side} | {r['load_s']:.1f} | {r['conv_per_s']:.2f} | {r['peak_rss_mb']:.0f} | {same} |",
                      flush=True)


if __name__ == "__main__":
    main()
