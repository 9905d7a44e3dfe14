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
# Decompression bombs: a header alone that claims a huge tensor (2^40 and
# 2^61 F32 elements, 3 GiB), and one whose declared header length is 100 MB.
# Decoding must fail with an error without allocating what they claim.
python=${MLX_LOWMEM_PYTHON:-../../target/interop-venv/bin/python3}
[ -x "$python" ] || python=python3
"$python" - "$seeds" <<'PY'
import struct, sys, zstandard
out = sys.argv[1]
def header_only(json_text):
    data = json_text.encode()
    return struct.pack("<Q", len(data)) + data
for name, elements in [("bomb-4tib", 1 << 40), ("bomb-8eib", 1 << 61), ("bomb-3gib", 3 << 28)]:
    raw = header_only('{"w":{"dtype":"F32","shape":[%d],"data_offsets":[0,%d]}}' % (elements, elements * 4))
    open(f"{out}/{name}.zst", "wb").write(zstandard.ZstdCompressor(level=19).compress(raw))
raw = struct.pack("<Q", 100 << 20) + b'{"w":'
open(f"{out}/bomb-header-100mb.zst", "wb").write(zstandard.ZstdCompressor(level=19).compress(raw))
PY
