"""Logits at every position under mlx_lm 0.32.2, for the engine's parity
tests in the checkpoint's own dtype.

Usage: mlx_lm_positions.py MODEL_DIR REQUEST_JSON

REQUEST_JSON: {"prefix": [ids], "suffixes": [[ids], ...]}, optionally
"whole": false and "widen_experts": true (see widened_experts.py). With mlx_lm's own caches (rotating ones on sliding layers):

- "prefix": the logits of every position of the prefix, one forward;
- "whole" (unless false): for every row, the logits of every position of
  prefix + suffix, one forward;
- "after_prefix": the logits of every suffix position, the suffix run on a
  deep copy of the prefix's prompt cache.

Prints {"version": ..., "dtype": ..., "prefix": [[...]], "whole":
[[[...]]], "after_prefix": [[[...]]]} as JSON (float32 values of the model's logits). mlx_lm 0.32.2
comes from `<venv>/mlx-lm-0.32.2` when `cargo xtask test` put it there.
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
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402
from widened_experts import widen_if_asked  # noqa: E402


def main():
    model, _ = load_model(Path(sys.argv[1]))
    request = json.loads(Path(sys.argv[2]).read_text())
    widen_if_asked(request)
    prefix, suffixes = request["prefix"], request["suffixes"]

    prefix_cache = make_prompt_cache(model)
    logits = model(mx.array([prefix]), cache=prefix_cache)[0]
    mx.eval([c.state for c in prefix_cache])
    dtype = str(logits.dtype)
    prefix_logits = logits.astype(mx.float32).tolist()

    whole, after_prefix = [], []
    for suffix in suffixes:
        if request.get("whole", True):
            logits = model(mx.array([prefix + suffix]), cache=make_prompt_cache(model))[0]
            whole.append(logits.astype(mx.float32).tolist())
        cache = copy.deepcopy(prefix_cache)
        logits = model(mx.array([suffix]), cache=cache)[0]
        after_prefix.append(logits.astype(mx.float32).tolist())
    print(
        json.dumps(
            {
                "version": mlx_lm.__version__,
                "mlx": mx.__version__,
                "dtype": dtype,
                "prefix": prefix_logits,
                "whole": whole,
                "after_prefix": after_prefix,
            }
        )
    )


main()
