"""Labels from the Python original: cc-sentiment 0.2.135's own
`SentimentClassifier` on spawnllm 0.17.1 + mlx-lm 0.31.3 + mlx 0.32.2 (CPU),
for the engine's test that keeps them (tests/data/cc_sentiment_original.json).

Usage: spawnllm_labels.py MODEL_DIR REQUEST_JSON [--through-mlx-lowmem]

With `--through-mlx-lowmem`, `spawnllm.mlx` resolves to our Python face
(`mlx_lowmem`, a `sys.modules` alias made before cc-sentiment is imported;
the rest of spawnllm stays the installed one, which cc-sentiment's other
engines import): the application's own code, unchanged, on our engine.

REQUEST_JSON: {"texts": [...]}. Each text becomes one conversation as the
application builds it (`build_prefix_messages()` + a user message of
`build_user_content(text)`), scored with `score_messages` (batch size 2, one
token, only "1".."5" allowed) and read with `extract_score`.

Needs Python >= 3.13 with `spawnllm[mlx]==0.17.1 mlx[cpu]==0.32.2
mlx-lm==0.31.3`, `cc-sentiment==0.2.135 --no-deps`, `cc-transcript>=14,<15`,
pydantic and anyio (see docs/mlx-engine.md, "Same answers as the original").
Both refuse to run off macOS on Apple Silicon: the platform checks are
answered with Apple Silicon's values while the classifier is imported and
built, and nothing else is changed.

Prints {"labels": [...], "prefix_tokens": N, "cache_offset": N, "versions":
{...}} as JSON.
"""
import asyncio
import json
import sys
from importlib.metadata import version
from pathlib import Path

THROUGH_OURS = "--through-mlx-lowmem" in sys.argv[3:]
if THROUGH_OURS:
    import spawnllm
    import mlx_lowmem

    sys.modules["spawnllm.mlx"] = mlx_lowmem
    spawnllm.mlx = mlx_lowmem

# Everything the classifier's module imports, imported on the real
# platform first (spawnllm and the standard library pick modules by it).
import spawnllm.mlx  # noqa: F401,E402
import cc_sentiment.adapter  # noqa: F401,E402
import cc_sentiment.engines.base  # noqa: F401,E402
from cc_sentiment.text import (  # noqa: E402
    build_prefix_messages,
    build_user_content,
    extract_score,
)
from apple_platform import ApplePlatform  # noqa: E402


async def main():
    model_dir = Path(sys.argv[1])
    request = json.loads(Path(sys.argv[2]).read_text())
    with ApplePlatform():
        from cc_sentiment.sentiment import SentimentClassifier

        classifier = SentimentClassifier(model_dir)
    await classifier.ensure_loaded()
    conversations = [
        [*build_prefix_messages(), {"role": "user", "content": build_user_content(t)}]
        for t in request["texts"]
    ]
    answers = await classifier.score_messages(conversations, lambda n: None)
    await classifier.close()
    print(
        json.dumps(
            {
                "labels": [str(int(extract_score(a))) for a in answers],
                "prefix_tokens": len(classifier.prefix_tokens),
                "cache_offset": int(classifier.base_cache[0].offset),
                "engine": type(classifier._engine).__module__,
                "versions": {
                    p: version(p)
                    for p in ["spawnllm", "mlx-lm", "mlx", "cc-sentiment"]
                    + (["mlx-lowmem"] if THROUGH_OURS else [])
                },
            }
        )
    )


asyncio.run(main())
