"""mlx_lm's batch_generate on the engine benchmark's conversations, with the
shared prefix's prompt cache computed once and copied per conversation.

Usage: mlx_lm_batch.py MODEL_DIR CONVERSATIONS.json BATCH_SIZE MAX_TOKENS
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
prefix = conversations[0][:1]
prefix_ids = tokenizer.apply_chat_template(prefix, add_generation_prompt=False)
cache = make_prompt_cache(model)
model(mx.array([prefix_ids]), cache=cache)
mx.eval([c.state for c in cache])
suffixes = [tokenizer.apply_chat_template(c, add_generation_prompt=True)[len(prefix_ids):] for c in conversations]
start = time.time()
caches = [copy.deepcopy(cache) for _ in suffixes]
out = batch_generate(model, tokenizer, suffixes, prompt_caches=caches, max_tokens=max_tokens,
                     completion_batch_size=batch, prefill_batch_size=batch)
seconds = time.time() - start
generated = sum(len(tokenizer.encode(t)) for t in out.texts)
print(seconds, len(conversations), sum(map(len, suffixes)), generated,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
