"""The Python original's fuse, step for step, for parity tests: load the base
with mlx_lm (non-strict, as spawnllm does), apply the adapter, fuse every
LoRA module, save with mlx_lm's `save`.

Usage: python_fuse.py BASE_DIR ADAPTER_DIR OUT_DIR [--mlx-lm-0.32.2]

ADAPTER_DIR holds `adapters.safetensors` and `adapter_config.json`. With
`--mlx-lm-0.32.2`, mlx_lm comes from `<venv>/mlx-lm-0.32.2` (where `cargo
xtask test` installs it) instead of the venv's 0.31.3. Prints
{"version": ..., "peak_rss_bytes": ...} as JSON.
"""
import json
import resource
import sys
from pathlib import Path

if "--mlx-lm-0.32.2" in sys.argv:
    sys.path.insert(0, str(Path(sys.prefix) / "mlx-lm-0.32.2"))

import mlx_lm  # noqa: E402
from mlx.utils import tree_unflatten  # noqa: E402
from mlx_lm.utils import load_adapters, load_model, load_tokenizer, save  # noqa: E402

base, adapter, out = (Path(a) for a in sys.argv[1:4])
model, config = load_model(base, lazy=False, strict=False)
model = load_adapters(model, str(adapter))
model.eval()
tokenizer = load_tokenizer(base, eos_token_ids=config.get("eos_token_id"))
fused = [(name, m.fuse()) for name, m in model.named_modules() if hasattr(m, "fuse")]
model.update_modules(tree_unflatten(fused))
out.mkdir(parents=True, exist_ok=True)
save(out, base, model, tokenizer, config, donate_model=True)
# ru_maxrss is in kilobytes on Linux.
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"version": mlx_lm.__version__, "peak_rss_bytes": peak}))
