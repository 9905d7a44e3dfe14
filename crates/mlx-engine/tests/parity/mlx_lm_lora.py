"""mlx_lm 0.32.2 serving an adapter unfused, for the per-row adapter parity
test: `mlx_lm.utils.load_adapters` wraps the model's linear layers in
`LoRALinear` (over `QuantizedLinear` for a 4-bit base) and loads the
adapter's pairs; the base weights stay as they are, as in the engine.

Usage: mlx_lm_lora.py MODEL_DIR REQUEST.json
REQUEST: {"adapter": ADAPTER_DIR, "prompts": [[token id, ...], ...]}
Prints {"version": mlx_lm's, "logprobs": [the last position's
log-probabilities (f32) of each prompt under the adapter], "base_logprobs":
[the same without it]} as JSON. mlx_lm 0.32.2 comes from
`<venv>/mlx-lm-0.32.2` when `cargo xtask test` put it there.
"""
import json
import sys
from pathlib import Path

newer = Path(sys.prefix) / "mlx-lm-0.32.2"
if newer.is_dir():
    sys.path.insert(0, str(newer))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.utils import load_adapters, load_model  # noqa: E402



def last_logprobs(model, prompts):
    out = []
    for ids in prompts:
        logits = model(mx.array([ids]))[0, -1, :].astype(mx.float32)
        out.append((logits - mx.logsumexp(logits)).tolist())
    return out


request = json.load(open(sys.argv[2]))
model, _ = load_model(Path(sys.argv[1]))
base = last_logprobs(model, request["prompts"])
model = load_adapters(model, request["adapter"])
model.eval()
adapted = last_logprobs(model, request["prompts"])
print(json.dumps({"version": mlx_lm.__version__, "logprobs": adapted, "base_logprobs": base}))
