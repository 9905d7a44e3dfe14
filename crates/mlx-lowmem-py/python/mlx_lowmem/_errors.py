"""The exceptions mlx_lowmem raises: one hierarchy rooted in `MlxLowmemError`.

Each class also derives from the builtin the Python originals raise in the
same case (`RuntimeError` for a failed load or a closed engine, `ValueError`
for bad input, `AttributeError` for what is not offered), so that code
written against spawnllm keeps catching what it caught. The message is the
Rust error's, which names the file, key, conversation or rank.
"""

from __future__ import annotations


class MlxLowmemError(Exception):
    """Every error mlx_lowmem raises derives from this."""


class ConfigError(MlxLowmemError, ValueError):
    """An engine option that cannot be used (unknown memory mode, batch size 0, ...)."""


class LoadError(MlxLowmemError, RuntimeError):
    """Loading the model, its tokenizer or the prefix's cache failed."""


class EngineClosedError(MlxLowmemError, RuntimeError):
    """The engine was closed (or its worker is gone)."""


class ConversationError(MlxLowmemError, ValueError):
    """A conversation the engine cannot answer: not starting with the prefix
    messages, nothing after them, too long, or not a list of role/content dicts."""


class GenerationError(MlxLowmemError, RuntimeError):
    """Generation failed inside the engine."""


class PeerTimeoutError(MlxLowmemError, TimeoutError):
    """A distributed peer rank did not answer in time."""


class TokenizerError(MlxLowmemError, ValueError):
    """The tokenizer or chat template could not handle the input."""


class AdapterError(MlxLowmemError, ValueError):
    """An adapter the engine cannot load or unload: it does not fit the model
    (the adapter and its first key that does not are named), its folder
    cannot be read, its name is taken, or requests still use it."""


class CodecError(MlxLowmemError, ValueError):
    """The adapter codec met a file it cannot encode or decode (the file is named)."""


class FuseError(MlxLowmemError, RuntimeError):
    """Fusing the adapter into the base model failed (repo, file and key are named)."""


class OfflineError(FuseError):
    """The base model is not in the hub cache and the hub may not be reached."""


class NotLoadedError(MlxLowmemError, AttributeError):
    """An engine attribute that exists only once the model is loaded
    (await `ensure_loaded()` first)."""


class NotOfferedError(MlxLowmemError, AttributeError):
    """What the original offers and this engine does not hold (the message says
    what to use instead)."""
