"""`AdapterCodec` and `AdapterFuser` against spawnllm's own (where it is
importable): the same `.zst` bytes and digest from the same adapter, the
same fused tensors from the same base, progress drawn with a tqdm class, and
typed errors. The fuses run in child interpreters, each with its own hub
cache in its environment (nothing here changes this process's)."""

from __future__ import annotations

import json
import tempfile
import textwrap
import unittest
from pathlib import Path

import numpy as np

import mlx_lowmem
from _support import (
    has,
    into_hub_cache,
    model_tensors,
    run_python,
    smollm2,
    write_safetensors,
    write_tiny_adapter,
    write_tiny_llama,
)


def codec_class(base: type, folder: Path) -> type:
    """A subclass pointing at `folder`, as an application ships one."""

    class Shipped(base):  # type: ignore[misc, valid-type]
        DIR = folder
        ZST = folder / "adapters.safetensors.zst"
        CONFIG = folder / "adapter_config.json"

    return Shipped


class Codec(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = Path(tempfile.mkdtemp())
        write_tiny_adapter(self.tmp / "adapter")

    def test_roundtrip_is_exact(self) -> None:
        ours = codec_class(mlx_lowmem.AdapterCodec, self.tmp / "adapter")
        ours.encode(self.tmp / "adapter" / "adapters.safetensors")
        ours().decode(self.tmp / "back.safetensors")  # an instance works as the class
        self.assertEqual((self.tmp / "back.safetensors").read_bytes(),
                         (self.tmp / "adapter" / "adapters.safetensors").read_bytes())
        self.assertEqual(ours.dtype(), "F32")
        self.assertRegex(ours.digest(), "^[0-9a-f]{16}$")

    @unittest.skipUnless(has("spawnllm") and has("zstandard"), "spawnllm[mlx] is not installed here")
    def test_same_bytes_and_digest_as_spawnllm(self) -> None:
        from spawnllm.mlx import AdapterCodec as Original

        src = self.tmp / "adapter" / "adapters.safetensors"
        (self.tmp / "theirs").mkdir()
        (self.tmp / "theirs" / "adapter_config.json").write_bytes((self.tmp / "adapter" / "adapter_config.json").read_bytes())
        ours = codec_class(mlx_lowmem.AdapterCodec, self.tmp / "adapter")
        theirs = codec_class(Original, self.tmp / "theirs")
        ours.encode(src)
        theirs.encode(src)
        self.assertEqual(ours.ZST.read_bytes(), theirs.ZST.read_bytes())
        self.assertEqual(ours.digest(), theirs.digest())

    def test_mixed_dtypes_are_refused_naming_the_file(self) -> None:
        bad = self.tmp / "mixed.safetensors"
        write_safetensors(bad, {"a": np.zeros((2, 2), np.float32), "b": np.zeros((2, 2), np.float16)})
        ours = codec_class(mlx_lowmem.AdapterCodec, self.tmp / "adapter")
        with self.assertRaisesRegex(mlx_lowmem.CodecError, "mixed.safetensors") as raised:
            ours.encode(bad)
        self.assertIsInstance(raised.exception, ValueError)

    def test_a_missing_zst_is_a_codec_error(self) -> None:
        ours = codec_class(mlx_lowmem.AdapterCodec, self.tmp / "nowhere")
        with self.assertRaisesRegex(mlx_lowmem.CodecError, "nowhere"):
            ours.digest()


FUSE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    {imports}

    class Shipped(AdapterCodec):
        DIR = Path({adapter!r})
        ZST = DIR / "adapters.safetensors.zst"
        CONFIG = DIR / "adapter_config.json"

    class Bar:
        made = []
        def __init__(self, total=None, desc=None, **kw):
            self.total, self.n, self.desc = total, 0, desc
            Bar.made.append(self)
        def update(self, k):
            self.n += k
        def set_description(self, d):
            self.desc = d
        def close(self):
            pass

    fused = AdapterFuser.ensure_fused("acme/tiny-llama", codec=Shipped(), cache_namespace="acme--fused",
                                      {tqdm})
    print(json.dumps({{"fused": str(fused), "bars": [[b.total, b.n, b.desc] for b in Bar.made]}}))
    """
)


class Progress(unittest.TestCase):
    def test_tqdm_draws_bytes_per_file_then_modules(self) -> None:
        from mlx_lowmem._adapter import _Progress

        class Bar:
            made: list = []

            def __init__(self, total=None, desc=None, **kw):
                self.total, self.n, self.desc, self.kw, self.closed = total, 0, desc, kw, False
                Bar.made.append(self)

            def update(self, k):
                self.n += k

            def close(self):
                self.closed = True

        progress = _Progress(Bar)
        for event in [("downloading", "config.json"), ("downloaded", "config.json", 10, 10),
                      ("downloading", "model.safetensors"), ("downloaded", "model.safetensors", 400, 1000),
                      ("downloaded", "model.safetensors", 1000, 1000), ("fusing", 1, 2), ("fusing", 2, 2),
                      ("published",)]:
            progress(*event)
        self.assertEqual([(b.desc, b.total, b.n, b.kw.get("unit")) for b in Bar.made],
                         [("config.json", 10, 10, "B"), ("model.safetensors", 1000, 1000, "B"),
                          ("fusing", 2, 2, "module")])
        self.assertTrue(all(b.closed for b in Bar.made))


class Fuser(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = Path(tempfile.mkdtemp())
        write_tiny_llama(cls.tmp / "base", smollm2("f32"))
        write_tiny_adapter(cls.tmp / "adapter")
        codec_class(mlx_lowmem.AdapterCodec, cls.tmp / "adapter").encode(cls.tmp / "adapter" / "adapters.safetensors")

    def fuse(self, name: str, imports: str, tqdm: bool) -> dict:
        cache = self.tmp / name / "hub"
        into_hub_cache(cache, "acme/tiny-llama", self.tmp / "base")
        code = FUSE.format(imports=imports, adapter=str(self.tmp / "adapter"),
                           tqdm="tqdm_class=Bar" if tqdm else "")
        out = run_python(code, {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
        return json.loads(out.strip().splitlines()[-1])

    def test_fuses_into_the_hub_cache_with_progress_and_hits_after(self) -> None:
        made = self.fuse("ours", "from mlx_lowmem import AdapterCodec, AdapterFuser", tqdm=True)
        fused = Path(made["fused"])
        digest = codec_class(mlx_lowmem.AdapterCodec, self.tmp / "adapter").digest()
        self.assertEqual(fused, self.tmp / "ours" / "hub" / f"models--acme--fused-{digest}" / "snapshots" / digest)
        self.assertTrue((fused / "config.json").is_file())
        fusing = [b for b in made["bars"] if b[2] == "fusing"]
        self.assertEqual(len(fusing), 1)
        self.assertEqual(fusing[0][0], 4, "four adapted modules")
        self.assertEqual(fusing[0][1], 4, "the bar reached its end")
        again = self.fuse("ours", "from mlx_lowmem import AdapterCodec, AdapterFuser", tqdm=False)
        self.assertEqual(again["fused"], made["fused"])

    @unittest.skipUnless(has("spawnllm") and has("mlx_lm"), "spawnllm[mlx] and mlx_lm are not installed here")
    def test_same_tensors_as_spawnllms_fuse(self) -> None:
        ours = Path(self.fuse("ours-vs", "from mlx_lowmem import AdapterCodec, AdapterFuser", tqdm=False)["fused"])
        theirs = Path(self.fuse("theirs", "from spawnllm.mlx import AdapterCodec, AdapterFuser", tqdm=False)["fused"])
        self.assertEqual(ours.name, theirs.name, "the same digest names both entries")
        a, b = model_tensors(ours), model_tensors(theirs)
        self.assertEqual(sorted(a), sorted(b))
        differing = [k for k in a if a[k] != b[k]]
        self.assertEqual(differing, [], "tensors whose dtype, shape or bytes differ")

    def test_an_offline_miss_is_an_offline_error_naming_the_repo(self) -> None:
        code = textwrap.dedent(
            f"""
            from pathlib import Path
            import mlx_lowmem
            class Shipped(mlx_lowmem.AdapterCodec):
                ZST = Path({str(self.tmp / "adapter" / "adapters.safetensors.zst")!r})
                CONFIG = Path({str(self.tmp / "adapter" / "adapter_config.json")!r})
            try:
                mlx_lowmem.AdapterFuser.ensure_fused("acme/not-here", codec=Shipped, cache_namespace="x--fused")
            except mlx_lowmem.OfflineError as e:
                assert isinstance(e, mlx_lowmem.FuseError) and "acme/not-here" in str(e), e
                print("offline")
            """
        )
        out = run_python(code, {"HF_HUB_CACHE": str(self.tmp / "empty"), "HF_HUB_OFFLINE": "1"})
        self.assertEqual(out.strip(), "offline")


if __name__ == "__main__":
    unittest.main()
