"""mlx_lm's batch_generate on the engine benchmark's conversations, with the
shared prefix's prompt cache computed once and deep-copied per conversation.

Usage: mlx_lm_batch.py MODEL_DIR CONVERSATIONS.json BATCH_SIZE MAX_TOKENS [MODE]
MODE "per-chunk" (the default) does what the original engine (spawnllm's
MlxEngine.generate) does: sort the conversations by the length of their last
message (stable), and call batch_generate once per chunk of BATCH_SIZE, with
the prefix cache deep-copied for each conversation of the chunk. MODE
"one-call" hands every conversation to a single batch_generate call.
Prints: seconds conversations prompt_tokens generated_tokens peak_rss_kib
"""
import copy
import json
import resource
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate
from mlx_lm.models.cache import make_prompt_cache

model, tokenizer = load(sys.argv[1])
conversations = json.load(open(sys.argv[2]))
batch, max_tokens = int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "per-chunk"
prefix = conversations[0][:1]
prefix_ids = tokenizer.apply_chat_template(prefix, add_generation_prompt=False)
cache = make_prompt_cache(model)
model(mx.array([prefix_ids]), cache=cache)
mx.eval([c.state for c in cache])
suffixes = [tokenizer.apply_chat_template(c, add_generation_prompt=True)[len(prefix_ids):] for c in conversations]


def generate(rows):
    caches = [copy.deepcopy(cache) for _ in rows]
    out = batch_generate(model, tokenizer, rows, prompt_caches=caches, max_tokens=max_tokens,
                         completion_batch_size=batch, prefill_batch_size=batch)
    return out.texts


start = time.time()
if mode == "one-call":
    texts = generate(suffixes)
elif mode == "per-chunk":
    order = sorted(range(len(conversations)), key=lambda i: len(conversations[i][-1]["content"]))
    texts = [None] * len(conversations)
    for at in range(0, len(order), batch):
        chunk = order[at:at + batch]
        for i, text in zip(chunk, generate([suffixes[i] for i in chunk])):
            texts[i] = text
else:
    sys.exit(f"unknown mode {mode!r}: per-chunk or one-call")
seconds = time.time() - start
generated = sum(len(tokenizer.encode(t)) for t in texts)
print(seconds, len(conversations), sum(map(len, suffixes)), generated,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
