"""The reference encoder of the adapter shipping format, as the Python
original (spawnllm's AdapterCodec) encodes: the 8-byte header length and
header JSON verbatim, each tensor's bytes shuffled by byte position within
its dtype (in order of the tensors' offsets), the whole one zstd frame made
by python-zstandard's ZstdCompressor(level).compress.

usage: encode.py SRC.safetensors OUT.zst [LEVEL]
"""

import json
import struct
import sys

import zstandard

TYPESIZE = {"F32": 4, "BF16": 2, "F16": 2}


def shuffled(data: bytes) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = bytearray(data[: 8 + n])
    tensors = sorted(
        (v for k, v in header.items() if k != "__metadata__"),
        key=lambda v: v["data_offsets"][0],
    )
    for t in tensors:
        start, end = t["data_offsets"]
        size = TYPESIZE[t["dtype"]]
        raw = body[start:end]
        for j in range(size):
            out += raw[j::size]
    return bytes(out)


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    level = int(sys.argv[3]) if len(sys.argv) > 3 else 19
    with open(src, "rb") as f:
        data = f.read()
    frame = zstandard.ZstdCompressor(level=level).compress(shuffled(data))
    with open(dst, "wb") as f:
        f.write(frame)


if __name__ == "__main__":
    main()
