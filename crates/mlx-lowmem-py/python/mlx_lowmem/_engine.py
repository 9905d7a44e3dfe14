"""`MlxEngine`: spawnllm's engine API over the Rust engine."""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

from mlx_lowmem import _native
from mlx_lowmem._errors import NotLoadedError, NotOfferedError

R = TypeVar("R")


async def _in_thread(function: Callable[..., R], *args: Any) -> R:
    """Runs a blocking native call (which releases the GIL) off the event loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: e.g. anyio on trio
        import anyio.to_thread

        return await anyio.to_thread.run_sync(functools.partial(function, *args))
    return await loop.run_in_executor(None, functools.partial(function, *args))


class MlxEngine:
    """Batched generation on a worker thread that owns MLX: spawnllm's
    `spawnllm.mlx.MlxEngine`, with the same arguments and methods.

    The constructor returns at once; the worker loads the model from
    `fused_dir`, calls `logits_processor_factory(tokenizer)` and computes the
    prefix messages' cache. `await ensure_loaded()` raises the load's error.

    By default the engine answers as the original does: the prefix's cache
    also holds the token generated after the prefix (``prefix_cache=
    "with_generated_token"``), and quantized weights are multiplied packed,
    as mlx_lm does (``quantized="keep"``). Keyword options beyond the
    original's:

    - ``memory``: where weights live — ``"resident"``,
      ``"experts_in_files"`` (a mixture of experts' experts read from the
      files as routed), ``"mapped_tables"`` (embedding tables left in the
      files, experts too) or ``"streamed"`` (each layer read for its turn);
      by default, what fits half the machine's memory.
    - ``quantized="dequantize_on_use"``: unpack quantized weights per
      product (much faster on a CPU; answers may then differ from mlx_lm's
      in the last bits of the logits). Left at None, the environment
      variable ``MLX_LOWMEM_QUANTIZED`` decides (so that an application
      that builds its engine itself can be switched without editing it),
      else ``"keep"``.
    - ``prefix_cache="clean"``: the prefix's tokens only.
    - ``lanes``: chunks run side by side; ``max_prompt_tokens``.
    - ``prefix_cache_dir``: a folder that keeps the prefix's computed cache
      across restarts (created if missing): a later engine with the same
      model, adapters, prefix and arithmetic reads it instead of computing
      it, and answers the same. Left at None, the environment variable
      ``MLX_LOWMEM_PREFIX_CACHE_DIR`` decides, else none.
      ``prefix_cache_max_bytes`` bounds the folder (least recently used
      out first).
    - ``adapters``: ``{name: folder}`` of mlx_lm adapter folders kept
      unfused beside the model; ``generate(..., adapter=name)`` decodes a
      call's conversations with one of them (the prefix's cache under it
      computed on its first use), so that several classifiers share one
      copy of the base weights instead of one fused copy each. More are
      loaded and unloaded while the engine runs: ``load_adapter``,
      ``unload_adapter``.

    Example::

        engine = MlxEngine(
            fused_dir,
            logits_processor_factory=lambda tokenizer: None or my_processor,
            prefix_messages=[{"role": "system", "content": "Rate from 1 to 5."}],
            batch_size=8,
        )
        await engine.ensure_loaded()
        texts = await engine.generate(conversations, lambda n: None)
        await engine.close()
    """

    def __init__(
        self,
        fused_dir: str | Path,
        *,
        logits_processor_factory: Callable[[Any], Callable[..., Any]] | None,
        prefix_messages: list[dict[str, str]],
        batch_size: int,
        worker_name: str = "mlx",
        memory: str | None = None,
        quantized: str | None = None,
        prefix_cache: str = "with_generated_token",
        lanes: int | None = None,
        max_prompt_tokens: int | None = None,
        prefix_cache_dir: str | Path | None = None,
        prefix_cache_max_bytes: int = 4 << 30,
        adapters: dict[str, str | Path] | None = None,
    ) -> None:
        self._fused_dir = Path(fused_dir)
        self._prefix_messages = prefix_messages
        if quantized is None:
            quantized = os.environ.get("MLX_LOWMEM_QUANTIZED", "keep")
        if prefix_cache_dir is None:
            prefix_cache_dir = os.environ.get("MLX_LOWMEM_PREFIX_CACHE_DIR") or None
        self._native = _native.Engine(
            str(fused_dir),
            logits_processor_factory=logits_processor_factory,
            prefix_messages=prefix_messages,
            batch_size=batch_size,
            worker_name=worker_name,
            memory=memory,
            quantized=quantized,
            prefix_cache=prefix_cache,
            lanes=lanes,
            max_prompt_tokens=max_prompt_tokens,
            prefix_cache_dir=None if prefix_cache_dir is None else str(prefix_cache_dir),
            prefix_cache_max_bytes=prefix_cache_max_bytes,
            adapters=None if adapters is None else {k: str(v) for k, v in adapters.items()},
        )
        self._loaded = False
        self._tokenizer: Any = None
        self._prefix_tokens: list[int] = []
        self._mlx_lm_model: Any = None
        self._mlx_lm_tokenizer: Any = None
        self._mlx_lm_cache: Any = None

    async def ensure_loaded(self) -> None:
        """Waits for the load; raises its error (every time it is awaited)."""
        await _in_thread(self._native.wait_loaded)
        if not self._loaded:
            # Kept, as the original keeps its attributes: they stay readable
            # after close().
            self._tokenizer = await _in_thread(self._native.tokenizer)
            self._prefix_tokens = await _in_thread(self._native.prefix_tokens)
            self._loaded = True

    async def submit(self, fn: Callable[..., R], *args: Any) -> R:
        """Runs ``fn(*args)`` on the worker thread, between generations, and
        returns its result (its exception propagates). ``fn`` runs with the
        GIL taken on that thread; it does not receive the model (see
        ``model`` for what is offered)."""
        return await _in_thread(self._native.submit, fn, args)

    async def generate(
        self,
        message_lists: list[list[dict[str, str]]],
        on_progress: Callable[[int], None],
        *,
        max_tokens: int = 1,
        adapter: str | None = None,
    ) -> list[str]:
        """One completion per conversation (greedy, `max_tokens` at most,
        default one token), in the order given. Each conversation starts
        with the engine's prefix messages. `on_progress(n)` is called on the
        event loop's thread after each batch with the number it answered.
        `adapter`: one of the names given in ``adapters``, which every
        conversation of the call decodes with (an unknown name raises
        `ConfigError`)."""
        loop = asyncio.get_running_loop()

        def progress(done: int) -> None:
            loop.call_soon_threadsafe(on_progress, done)

        return await _in_thread(self._native.generate, message_lists, max_tokens, progress, adapter)

    async def load_adapter(self, name: str, folder: str | Path) -> None:
        """Serves the mlx_lm adapter folder `folder` as `name`, unfused, from
        the next call on (``generate(..., adapter=name)``); the base weights
        are not copied. Raises `AdapterError` naming the adapter and its
        first key that fits no layer of the model, or a name already
        served; the adapters served stay as they were."""
        await _in_thread(self._native.load_adapter, name, str(folder))

    async def unload_adapter(self, name: str) -> None:
        """Stops serving the adapter `name` (and drops the prefix's cache
        under it). `ConfigError` when no adapter is called so."""
        await _in_thread(self._native.unload_adapter, name)

    async def adapters(self) -> list[str]:
        """The names of the adapters served, in the order they were loaded."""
        return await _in_thread(self._native.adapters)

    def peak_memory_gb(self) -> float:
        """The process's peak resident set size in GiB, from the OS (the
        original divides `ru_maxrss` by 1024³, which is right on macOS and
        1024× too small on Linux, where it counts KiB)."""
        peak = self._native.peak_memory_bytes()
        return 0.0 if peak is None else peak / 1024**3

    def mlx_peak_memory_gb(self) -> float:
        """MLX's own peak memory in GiB (its allocator's high-water mark)."""
        return self._native.mlx_peak_memory_bytes() / 1024**3

    async def close(self) -> None:
        """Lets queued work finish, then stops the worker; later calls raise
        `EngineClosedError`."""
        await _in_thread(self._native.close)

    def _require_loaded(self, name: str) -> None:
        if not self._loaded:
            raise NotLoadedError(f"MlxEngine.{name} exists once the model is loaded: await ensure_loaded() first")

    @property
    def tokenizer(self) -> _native.Tokenizer:
        """The model's tokenizer (the object the logits processor factory
        received): `encode`, `decode`, `eos_token_id`, `vocab_size`,
        `apply_chat_template` as mlx_lm's `TokenizerWrapper` offers them."""
        self._require_loaded("tokenizer")
        return self._tokenizer

    @property
    def logit_processor(self) -> Callable[..., Any] | None:
        """What the logits processor factory returned."""
        self._require_loaded("logit_processor")
        return self._native.logits_processor()

    @property
    def prefix_messages(self) -> list[dict[str, str]]:
        """The messages every conversation starts with."""
        return self._prefix_messages

    @property
    def prefix_tokens(self) -> list[int]:
        """The prefix messages' token ids (chat template, no generation prompt)."""
        self._require_loaded("prefix_tokens")
        return list(self._prefix_tokens)

    @property
    def model(self) -> Any:
        """mlx_lm's model of the same folder, loaded on first use, for code
        that hands it to mlx_lm (e.g. `mlx_lm.batch_generate`). The engine's
        own model is Rust and not an `mlx.nn.Module`; this one is a second
        copy of the weights in memory. Needs `mlx_lm` (the `mlx` extra)."""
        self._require_loaded("model")
        if self._mlx_lm_model is None:
            mlx_lm = self._mlx_lm("model")
            self._mlx_lm_model, self._mlx_lm_tokenizer = mlx_lm.load(str(self._fused_dir))
        return self._mlx_lm_model

    @property
    def base_cache(self) -> list[Any]:
        """The prefix's cache as the original builds it, made with mlx_lm
        from `model` on first use (mlx_lm's cache objects, not the engine's,
        which lives in Rust). Needs `mlx_lm` (the `mlx` extra)."""
        self._require_loaded("base_cache")
        if self._mlx_lm_cache is None:
            mlx_lm = self._mlx_lm("base_cache")
            processor = self._native.logits_processor()
            model = self.model
            self._mlx_lm_cache = mlx_lm.batch_generate(
                model,
                self._mlx_lm_tokenizer,
                [self.prefix_tokens],
                max_tokens=1,
                logits_processors=[processor] if processor is not None else None,
                return_prompt_caches=True,
            ).caches[0]
        return self._mlx_lm_cache

    @staticmethod
    def _mlx_lm(name: str) -> Any:
        try:
            import mlx_lm
        except ImportError as e:
            raise NotOfferedError(
                f"MlxEngine.{name}: the engine's model is Rust, not an mlx.nn.Module; "
                f"install mlx-lm (pip install 'mlx-lowmem[mlx]') to get mlx_lm's own {name} "
                "of the same folder, or use generate() / submit()"
            ) from e
        return mlx_lm
