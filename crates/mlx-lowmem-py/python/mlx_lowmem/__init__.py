"""mlx_lowmem: batched MLX inference on little memory, from Python.

The Python face of the mlx-lowmem Rust toolkit, with the names and
signatures of spawnllm's `spawnllm.mlx` (`MlxEngine`, `AdapterCodec`,
`AdapterFuser`), so that code written for it runs by changing one import::

    from mlx_lowmem import AdapterFuser, MlxEngine

The engine is Rust (one worker thread owns MLX; the GIL is released while it
works); its options beyond the original's are keyword arguments of
`MlxEngine`. See `help(mlx_lowmem.MlxEngine)` and the project's
docs/python.md.
"""

from mlx_lowmem import _errors as errors
from mlx_lowmem._adapter import AdapterCodec, AdapterFuser
from mlx_lowmem._engine import MlxEngine
from mlx_lowmem._errors import (
    AdapterError,
    CodecError,
    ConfigError,
    ConversationError,
    EngineClosedError,
    FuseError,
    GenerationError,
    LoadError,
    MlxLowmemError,
    NotLoadedError,
    NotOfferedError,
    OfflineError,
    PeerTimeoutError,
    TokenizerError,
)
from mlx_lowmem._native import MLX_VERSION, Tokenizer

__all__ = [
    "MLX_VERSION",
    "AdapterCodec",
    "AdapterError",
    "AdapterFuser",
    "CodecError",
    "ConfigError",
    "ConversationError",
    "EngineClosedError",
    "FuseError",
    "GenerationError",
    "LoadError",
    "MlxEngine",
    "MlxLowmemError",
    "NotLoadedError",
    "NotOfferedError",
    "OfflineError",
    "PeerTimeoutError",
    "Tokenizer",
    "TokenizerError",
    "errors",
]
