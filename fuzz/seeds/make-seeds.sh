#!/usr/bin/env bash
# Writes the decode target's seed inputs: small valid adapters, compressed.
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
python3 - "$tmp" <<'PY'
import json, struct, sys
out = sys.argv[1]
for name, dtype, size, n in [("f32", "F32", 4, 6), ("bf16", "BF16", 2, 9), ("f16", "F16", 2, 3)]:
    tensors = {f"l.{i}.lora_a": {"dtype": dtype, "shape": [n], "data_offsets": [i * n * size, (i + 1) * n * size]} for i in range(2)}
    header = json.dumps(tensors).encode()
    body = bytes((k * 37) % 251 for k in range(2 * n * size))
    open(f"{out}/{name}.safetensors", "wb").write(struct.pack("<Q", len(header)) + header + body)
PY
seeds=$(pwd)/decode
mkdir -p "$seeds"
for f in "$tmp"/*.safetensors; do
  (cd ../.. && cargo xtask encode-adapter "$f" --out "$seeds/$(basename "$f" .safetensors).zst" --level 3 >/dev/null)
done
rm -rf "$tmp"
