"""A tiny checkpoint converted by mlx_lm 0.32.2's own `convert`, as users
make MLX checkpoints: the weights cast to a dtype and, when asked,
affine-quantized.

Usage: mlx_lm_convert.py SRC_DIR DST_DIR DTYPE [BITS GROUP_SIZE]

DTYPE: bfloat16 or float16. With BITS and GROUP_SIZE the model is quantized
as `mlx_lm.convert -q --q-bits BITS --q-group-size GROUP_SIZE` does. mlx_lm
0.32.2 comes from `<venv>/mlx-lm-0.32.2` when `cargo xtask test` put it
there. Prints {"version": ...}.
"""
import json
import sys
from pathlib import Path

newer = Path(sys.prefix) / "mlx-lm-0.32.2"
if newer.is_dir():
    sys.path.insert(0, str(newer))

import mlx_lm  # noqa: E402
from mlx_lm.convert import convert  # noqa: E402


def main():
    src, dst, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
    quantize = len(sys.argv) > 4
    bits = int(sys.argv[4]) if quantize else None
    group_size = int(sys.argv[5]) if quantize else None
    convert(
        hf_path=src,
        mlx_path=dst,
        quantize=quantize,
        q_bits=bits,
        q_group_size=group_size,
        dtype=dtype,
    )
    print(json.dumps({"version": mlx_lm.__version__}))


main()
