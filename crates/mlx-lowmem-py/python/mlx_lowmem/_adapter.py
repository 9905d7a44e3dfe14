"""`AdapterCodec` and `AdapterFuser`: spawnllm's adapter API over the Rust codec and fuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from mlx_lowmem import _native


class AdapterCodec:
    """A LoRA adapter shipped as one byte-shuffled zstd frame: spawnllm's
    `spawnllm.mlx.AdapterCodec`, byte for byte (same `.zst` from the same
    adapter, same digest).

    Subclass it and point the class attributes at your package data, as the
    original's users do::

        class ShippedCodec(AdapterCodec):
            DIR = Path(__file__).parent
            ZST = DIR / "adapters.safetensors.zst"
            CONFIG = DIR / "adapter_config.json"

        ShippedCodec.encode(Path("trained/adapters.safetensors"))
        print(ShippedCodec.digest())

    The methods are class methods; an instance (``ShippedCodec()``) works
    the same, which is how `AdapterFuser.ensure_fused` receives it.
    """

    DIR: ClassVar[Path] = Path(__file__).parent
    ZST: ClassVar[Path] = DIR / "adapters.safetensors.zst"
    CONFIG: ClassVar[Path] = DIR / "adapter_config.json"
    TYPESIZES: ClassVar[dict[str, int]] = {"F32": 4, "BF16": 2, "F16": 2}
    COMPRESSION_LEVEL: ClassVar[int] = 19

    @classmethod
    def digest(cls) -> str:
        """The first 16 hex digits of the SHA-256 of `ZST`."""
        return _native.codec_digest(str(cls.ZST), str(cls.CONFIG))

    @classmethod
    def encode(cls, src: Path) -> None:
        """Compresses the safetensors adapter `src` (one dtype of F32, BF16,
        F16) into `ZST` at `COMPRESSION_LEVEL`."""
        _native.codec_encode(str(cls.ZST), str(cls.CONFIG), str(src), cls.COMPRESSION_LEVEL)

    @classmethod
    def decode(cls, dst: Path) -> None:
        """Restores `ZST` into the safetensors file `dst`."""
        _native.codec_decode(str(cls.ZST), str(cls.CONFIG), str(dst))

    @classmethod
    def dtype(cls) -> str:
        """The dtype the compressed adapter's tensors share, e.g. ``"BF16"``."""
        return _native.codec_dtype(str(cls.ZST), str(cls.CONFIG))


class _Progress:
    """Fuse events drawn with a tqdm class: one bar of bytes per downloaded
    file (as `snapshot_download(tqdm_class=...)` draws them), then one bar of
    adapted modules while fusing."""

    def __init__(self, tqdm_class: Any) -> None:
        self.tqdm_class = tqdm_class
        self.bar: Any = None
        self.showing = ""

    def _bar(self, showing: str, **kwargs: Any) -> Any:
        if self.showing != showing:
            self.close()
            self.bar = self.tqdm_class(**kwargs)
            self.showing = showing
        return self.bar

    def __call__(self, kind: str, *details: Any) -> None:
        if kind == "downloaded":
            file, done, total = details
            bar = self._bar("bytes:" + file, total=total, desc=file, unit="B", unit_scale=True)
            bar.update(done - bar.n)
        elif kind == "fusing":
            done, total = details
            bar = self._bar("fusing", total=total, desc="fusing", unit="module")
            bar.update(done - bar.n)
        elif kind == "waiting":
            self._bar("waiting", total=None, desc="waiting for another process fusing this adapter")
        elif kind == "published":
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.showing = None, ""


class AdapterFuser:
    """Fuses a shipped LoRA adapter into a base MLX model, cached in the
    Hugging Face hub layout: spawnllm's `spawnllm.mlx.AdapterFuser`, with
    tensors equal to mlx_lm's fuse (see the adapter-fuse guide for the BLAS
    setting that makes them bit-equal on Linux)."""

    @classmethod
    def ensure_fused(
        cls,
        model_repo: str,
        *,
        codec: AdapterCodec | type[AdapterCodec],
        cache_namespace: str,
        tqdm_class: type | None = None,
    ) -> Path:
        """The fused model's snapshot folder
        ``{hub cache}/models--{cache_namespace}-{digest}/snapshots/{digest}``,
        fusing on a miss (the base downloaded from the hub unless cached; a
        crash leaves no entry; concurrent callers share one fuse). The hub
        cache, endpoint, token and offline switch come from the same
        environment variables huggingface_hub reads. `tqdm_class`, if given,
        draws the progress: the bytes of each downloaded file, then the
        adapted modules."""
        progress = _Progress(tqdm_class) if tqdm_class is not None else None
        try:
            fused = _native.fuse(model_repo, str(codec.ZST), str(codec.CONFIG), cache_namespace, progress)
        finally:
            if progress is not None:
                progress.close()
        return Path(fused)
