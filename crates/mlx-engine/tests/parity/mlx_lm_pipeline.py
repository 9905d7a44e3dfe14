"""mlx_lm 0.32.2's own pipeline parallelism, as one rank of a job started by
a launcher (MLX_RANK / MLX_HOSTFILE): `sharded_load(pipeline_group=…)`, then
greedy generation for each conversation.

Usage: mlx_lm_pipeline.py MODEL_DIR CONVERSATIONS_JSON MAX_TOKENS

CONVERSATIONS_JSON: a list of conversations, each a list of {"role",
"content"}. Rank 0 prints `RESULT {"version": ..., "texts": [...]}`.
"""
import json
import sys
from pathlib import Path

newer = Path(sys.prefix) / "mlx-lm-0.32.2"
if newer.is_dir():
    sys.path.insert(0, str(newer))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.utils import sharded_load  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

model_dir, conversations_path, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
group = mx.distributed.init(strict=True, backend="ring")
model, wrapper = sharded_load(model_dir, pipeline_group=group)
# The test model's word-level tokenizer.json, read as the engine reads it
# (transformers would pick a tokenizer class by the model type instead).
words = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
eos = json.loads((Path(model_dir) / "config.json").read_text())["eos_token_id"]
texts = []
for conversation in json.loads(Path(conversations_path).read_text()):
    # The chat template rendered to text, then tokenized without adding
    # special tokens: what the engine does.
    text = wrapper.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    prompt = mx.array(words.encode(text, add_special_tokens=False).ids)
    tokens = []
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        token = int(token)
        if token == eos:
            break
        tokens.append(token)
    texts.append(words.decode(tokens))
if group.rank() == 0:
    print("RESULT " + json.dumps({"version": mlx_lm.__version__, "texts": texts}), flush=True)
