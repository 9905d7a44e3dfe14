"""Reference outputs of mlx_lm on an imported model, for the parity test.

Usage: mlx_lm_smollm2.py MODEL_DIR PROMPTS.json
For each prompt (a list of chat messages): the chat-template token ids, the
last-position logits, and the greedy continuation (8 tokens) as token ids.
Prints one JSON list.
"""
import json
import sys

import mlx.core as mx
from mlx_lm import load

model, tokenizer = load(sys.argv[1])
results = []
for messages in json.load(open(sys.argv[2])):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    logits = model(mx.array([ids]))[0, -1, :].astype(mx.float32)
    tokens = list(ids)
    continuation = []
    for _ in range(8):
        nxt = int(mx.argmax(model(mx.array([tokens]))[0, -1, :]).item())
        if nxt in tokenizer.eos_token_ids:
            break
        continuation.append(nxt)
        tokens.append(nxt)
    results.append({"ids": ids, "logits": logits.tolist(), "continuation": continuation})
print(json.dumps(results))
