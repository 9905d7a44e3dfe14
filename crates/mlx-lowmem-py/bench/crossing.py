"""What a Python logits processor costs per decoding step: the same
generation with no processor and with a pass-through one (`lambda tokens,
logits: logits`, called as mlx_lm calls it: once per row, `mlx.core` arrays),
so that the difference is the crossing alone (the answers are equal).

Usage: crossing.py MODEL_DIR [--batch 8] [--tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from mlx_lowmem import MlxEngine

PREFIX = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
QUESTIONS = ["What is a CPU?", "Name a prime.", "Why is the sky blue?", "What is Rust?",
             "Define entropy.", "What is MLX?", "Say hello.", "Count to three."]


async def timed(model: str, factory, batch: int, tokens: int) -> tuple[float, list[str], int]:
    engine = MlxEngine(model, logits_processor_factory=factory, prefix_messages=PREFIX, batch_size=batch,
                       quantized="dequantize_on_use", prefix_cache="clean", lanes=1)
    await engine.ensure_loaded()
    conversations = [PREFIX + [{"role": "user", "content": q}] for q in QUESTIONS[:batch]]
    clock = time.perf_counter()
    texts = await engine.generate(conversations, lambda n: None, max_tokens=tokens)
    seconds = time.perf_counter() - clock
    vocab = len(engine.tokenizer)
    await engine.close()
    return seconds, texts, vocab


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    calls = {"n": 0}

    def through(tokenizer):
        def processor(tokens, logits):
            calls["n"] += 1
            return logits

        return processor

    plain, crossed = [], []
    for _ in range(args.rounds):
        s, a, vocab = await timed(args.model, None, args.batch, args.tokens)
        plain.append(s)
        s, b, _ = await timed(args.model, through, args.batch, args.tokens)
        crossed.append(s)
        assert a == b, "a pass-through processor changed the answers"
    steps = args.tokens  # at most; conversations may stop early at EOS
    extra = (min(crossed) - min(plain)) / steps
    print(f"batch {args.batch}, {args.tokens} tokens, vocab {vocab}: best of {args.rounds}: "
          f"{min(plain):.3f} s without a processor, {min(crossed):.3f} s with a pass-through one; "
          f"{extra * 1e3:.2f} ms per decoding step ({extra / args.batch * 1e3:.2f} ms per row); "
          f"{calls['n']} processor calls")


asyncio.run(main())
