"""Gemma under mlx_lm 0.32.2, for the engine's parity tests.

Usage: mlx_lm_gemma.py MODEL_DIR REQUEST_JSON

REQUEST_JSON: {"prefix": [ids], "suffixes": [[ids], ...], "max_tokens": N,
"eos": [ids]}, optionally "allowed": [ids] (a logits processor that leaves
only those tokens, as cc-sentiment's does), "batch_only": true (skip the
rows alone), "widen_experts": true (see widened_experts.py) and "spawnllm_prefix": true (the prefix's cache made as
spawnllm makes it: `batch_generate([prefix], max_tokens=1,
return_prompt_caches=True)`, which also holds the token generated after
the prefix, under the processor). For every row (prefix + suffix), with mlx_lm's own caches
(rotating ones on sliding layers):

- "alone_logits": the last prompt position's logits, the prefix and the
  suffix run one after the other into one cache;
- "alone_greedy": N greedy tokens continuing that cache, stopping at EOS;
- "batch_greedy": N greedy tokens from `batch_generate` over all rows at
  once, each row starting from a deep copy of the prefix's prompt cache
  (what spawnllm's engine does).

Prints {"version": ..., "alone_logits": ..., "alone_greedy": ...,
"batch_greedy": ...} as JSON. mlx_lm 0.32.2 comes from
`<venv>/mlx-lm-0.32.2` when `cargo xtask test` put it there (the venv's own
mlx_lm is the 0.31.3 that the fusing tests compare against).
"""
import copy
import json
import os
import sys
from pathlib import Path

newer = Path(sys.prefix) / "mlx-lm-0.32.2"
if newer.is_dir():
    sys.path.insert(0, str(newer))
# mlx_lm 0.32.2's quantized experts call `gather_qmm` with an argument
# that MLX 0.32.2 lacks: their reference runs on the MLX 0.32.4 that
# `cargo xtask test` keeps beside the venv.
if os.environ.get("MLX_LOWMEM_NEWER_MLX"):
    sys.path.insert(0, str(Path(sys.prefix) / "mlx-0.32.4"))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import batch_generate  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402
from widened_experts import widen_if_asked  # noqa: E402


class Ids:
    """What batch_generate needs of a tokenizer when prompts are ids."""

    def __init__(self, eos):
        self.eos_token_ids = eos

    def decode(self, ids):
        return ""


def main():
    model, _ = load_model(Path(sys.argv[1]))
    request = json.loads(Path(sys.argv[2]).read_text())
    widen_if_asked(request)
    prefix, suffixes = request["prefix"], request["suffixes"]
    max_tokens, eos = request["max_tokens"], request["eos"]

    processors = []
    if request.get("allowed") is not None:
        allowed = mx.array(request["allowed"])

        def only_allowed(tokens, logits):
            kept = mx.full(logits.shape, -1e9)
            kept[..., allowed] = logits[..., allowed]
            return kept

        processors.append(only_allowed)

    if request.get("spawnllm_prefix"):
        made = batch_generate(
            model,
            Ids(eos),
            [prefix],
            max_tokens=1,
            return_prompt_caches=True,
            logits_processors=processors,
        )
        prefix_cache = made.caches[0]
    else:
        prefix_cache = make_prompt_cache(model)
        model(mx.array([prefix]), cache=prefix_cache)
    mx.eval([c.state for c in prefix_cache])

    alone_logits, alone_greedy = [], []
    for suffix in [] if request.get("batch_only") else suffixes:
        cache = copy.deepcopy(prefix_cache)
        logits = model(mx.array([suffix]), cache=cache)[0, -1]
        alone_logits.append(logits.astype(mx.float32).tolist())
        out = []
        for _ in range(max_tokens):
            token = int(mx.argmax(logits).item())
            if token in eos:
                break
            out.append(token)
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
        alone_greedy.append(out)

    caches = [copy.deepcopy(prefix_cache) for _ in suffixes]
    batch = batch_generate(
        model,
        Ids(eos),
        suffixes,
        prompt_caches=caches,
        max_tokens=max_tokens,
        return_token_ids=True,
        logits_processors=processors,
    )
    print(
        json.dumps(
            {
                "version": mlx_lm.__version__,
                "mlx": mx.__version__,
                "alone_logits": alone_logits,
                "alone_greedy": alone_greedy,
                "batch_greedy": batch.token_ids,
            }
        )
    )


main()
