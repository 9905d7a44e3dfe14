"""cc-sentiment 0.2.135 as the application runs it, on our Python face:
`spawnllm.mlx` resolves to `mlx_lowmem` (a `sys.modules` alias made before
cc-sentiment is imported; the rest of spawnllm is the installed one), then
the application's own `AdapterFuser.ensure_fused(DEFAULT_MODEL)` (its codec,
its cache namespace), `SentimentClassifier(fused_dir)`, `ensure_loaded()`,
`score_messages(...)` over conversations built with its
`build_prefix_messages()` / `build_user_content(text)`, and `extract_score`.

Usage: cc_sentiment_app.py REQUEST_JSON [BATCH_SIZE]

REQUEST_JSON: {"texts": [...]}. The hub cache, offline switch and our
engine's arithmetic come from the environment (HF_HUB_CACHE,
HF_HUB_OFFLINE, MLX_LOWMEM_QUANTIZED). BATCH_SIZE, if given, replaces the
classifier's class attribute BATCH_SIZE (2), as a subclass would.

Prints {"fused": ..., "labels": [...], "seconds": {...}, "peak_rss_bytes":
N, "versions": {...}} as JSON.
"""

import asyncio
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import spawnllm
import mlx_lowmem

sys.modules["spawnllm.mlx"] = mlx_lowmem
spawnllm.mlx = mlx_lowmem

import cc_sentiment.adapter  # noqa: F401,E402
import cc_sentiment.engines.base  # noqa: F401,E402
from cc_sentiment.engines.protocol import DEFAULT_MODEL  # noqa: E402
from cc_sentiment.text import (  # noqa: E402
    build_prefix_messages,
    build_user_content,
    extract_score,
)
from apple_platform import ApplePlatform  # noqa: E402


async def main():
    request = json.loads(Path(sys.argv[1]).read_text())
    with ApplePlatform():
        from cc_sentiment.sentiment import AdapterFuser, SentimentClassifier
    if len(sys.argv) > 2:
        SentimentClassifier.BATCH_SIZE = int(sys.argv[2])
    clock = time.perf_counter()
    fused = AdapterFuser.ensure_fused(DEFAULT_MODEL)
    fused_s = time.perf_counter() - clock
    with ApplePlatform():
        classifier = SentimentClassifier(fused)
    await classifier.ensure_loaded()
    loaded_s = time.perf_counter() - clock - fused_s
    conversations = [
        [*build_prefix_messages(), {"role": "user", "content": build_user_content(t)}]
        for t in request["texts"]
    ]
    clock = time.perf_counter()
    answers = await classifier.score_messages(conversations, lambda n: None)
    scored_s = time.perf_counter() - clock
    peak = classifier.peak_memory_gb() * 1024**3
    await classifier.close()
    print(
        json.dumps(
            {
                "fused": str(fused),
                "labels": [str(int(extract_score(a))) for a in answers],
                "prefix_tokens": len(classifier.prefix_tokens),
                "seconds": {"fuse": fused_s, "load": loaded_s, "score": scored_s},
                "peak_rss_bytes": int(peak),
                "versions": {p: version(p) for p in ["mlx-lowmem", "cc-sentiment", "spawnllm"]},
            }
        )
    )


asyncio.run(main())
