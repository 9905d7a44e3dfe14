"""Where a step's logits cross from the engine's MLX to a Python processor.

The engine and the `mlx` package share one libmlx in the process (the
wheel loads the `mlx` package's), but not their array objects: the engine's
arrays are Rust handles, `mlx.core.array` is a nanobind object that only the
package's own bindings create. Each decoding step's logits therefore come
here as float32 bytes, become one array per row
(`mlx.core` when importable, else numpy), go through the processor as mlx_lm
calls it — `processor(tokens, logits)` per row, logits of shape `(1, vocab)`
— and go back as bytes.

`tokens` is an empty int32 array: the engine does not keep each row's token
history for its processors (mlx_lm passes the row's prompt and generated
ids). Processors that read only the logits, such as a label mask, are
unaffected.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

try:
    import mlx.core as mx
except ImportError:  # numpy arrays then
    mx = None


def process_rows(processor: Callable[[Any, Any], Any], data: bytes, rows: int, vocab: int) -> bytes:
    """The processor applied to each row of `data` (rows × vocab float32)."""
    logits = np.frombuffer(data, dtype=np.float32).reshape(rows, vocab)
    out = np.empty((rows, vocab), dtype=np.float32)
    tokens = np.zeros(0, dtype=np.int32)
    if mx is not None:
        tokens = mx.array(tokens)
    for r in range(rows):
        row = logits[r : r + 1]
        result = processor(tokens, mx.array(row) if mx is not None else row)
        if mx is not None and isinstance(result, mx.array):
            result = np.array(result.astype(mx.float32))
        result = np.asarray(result, dtype=np.float32)
        if result.size != vocab:
            raise ValueError(
                f"the logits processor returned shape {result.shape}; expected (1, {vocab}) as it was given"
            )
        out[r] = result.reshape(vocab)
    return out.tobytes()
