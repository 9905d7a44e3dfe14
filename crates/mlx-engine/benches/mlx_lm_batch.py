"""mlx_lm's batch_generate on the engine benchmark's conversations, with the
shared prefix's prompt cache computed once and deep-copied per conversation.

Usage: mlx_lm_batch.py MODEL_DIR CONVERSATIONS.json BATCH_SIZE MAX_TOKENS [MODE]
MODE "per-chunk" (the default) does what the original engine (spawnllm's
MlxEngine.generate) does: sort the conversations by the length of their last
message (stable), and call batch_generate once per chunk of BATCH_SIZE, with
the prefix cache deep-copied for each conversation of the chunk. MODE
"one-call" hands every conversation to a single batch_generate call.
Prints: seconds conversations prompt_tokens generated_tokens peak_rss_kib
io=RCHAR/READ_BYTES (the timed part's reads, /proc/self/io)
(after a first line naming the mlx_lm version).
"""
import copy
import json
import os
import resource
import sys
import time
from pathlib import Path

# mlx_lm 0.32.2 (Gemma 3 and 4 as the engine implements them) sits beside
# the venv's own 0.31.3 when `cargo xtask` set the venv up.
newer = Path(sys.prefix) / "mlx-lm-0.32.2"
if newer.is_dir():
    sys.path.insert(0, str(newer))
# MLX 0.32.4 first where asked (MLX_BENCH_NEWER_MLX=1): mlx_lm 0.32.2's
# quantized experts need it (the venv's own MLX is 0.32.2).
newer_mlx = Path(sys.prefix) / "mlx-0.32.4"
if os.environ.get("MLX_BENCH_NEWER_MLX") == "1" and newer_mlx.is_dir():
    sys.path.insert(0, str(newer_mlx))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import batch_generate  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from process_io import read_io  # noqa: E402 (beside this script)



print(f"mlx_lm {mlx_lm.__version__}")
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


io_before = read_io()
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
io = [a - b for a, b in zip(read_io(), io_before)]
generated = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
print(seconds, len(conversations), sum(map(len, suffixes)), generated,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, f"io={io[0]}/{io[1]}")
