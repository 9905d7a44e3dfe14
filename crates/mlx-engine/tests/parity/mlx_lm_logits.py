"""Last-position logits of a model folder under mlx_lm, for parity tests.

Usage: mlx_lm_logits.py MODEL_DIR TOKEN [TOKEN ...]
Prints the logits as one JSON list.
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model

model, _ = load_model(Path(sys.argv[1]))
tokens = mx.array([[int(t) for t in sys.argv[2:]]])
print(json.dumps(model(tokens)[0, -1, :].astype(mx.float32).tolist()))
