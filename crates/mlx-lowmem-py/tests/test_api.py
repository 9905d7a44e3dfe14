"""The originals' names and signatures: code written for spawnllm's
`spawnllm.mlx` calls ours the same way. Compared against the installed
spawnllm 0.17.1 itself where it is importable (the face venv)."""

from __future__ import annotations

import inspect
import unittest

import mlx_lowmem
from _support import has


def parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@unittest.skipUnless(has("spawnllm"), "spawnllm is not installed here (the face venv has it)")
class SameAsSpawnllm(unittest.TestCase):
    def setUp(self) -> None:
        from spawnllm.mlx.codec import AdapterCodec
        from spawnllm.mlx.engine import MlxEngine
        from spawnllm.mlx.fuse import AdapterFuser

        self.original = {"MlxEngine": MlxEngine, "AdapterCodec": AdapterCodec, "AdapterFuser": AdapterFuser}

    def extends(self, ours, original) -> list:
        """Ours takes the original's parameters, in its order, then only
        keyword options with defaults: a call written for the original
        works unchanged. Returns those options."""
        original, ours = parameters(original), parameters(ours)
        self.assertEqual(ours[: len(original)], original)
        extra = ours[len(original) :]
        self.assertTrue(all(kind is inspect.Parameter.KEYWORD_ONLY and default is not inspect.Parameter.empty
                            for _, kind, default in extra), extra)
        return extra

    def test_engine_takes_the_originals_arguments_then_ours_as_keywords(self) -> None:
        extra = self.extends(mlx_lowmem.MlxEngine.__init__, self.original["MlxEngine"].__init__)
        self.assertTrue(extra, "ours adds its options")

    def test_engine_methods_match(self) -> None:
        for name in ["ensure_loaded", "submit", "generate", "close"]:
            with self.subTest(name):
                ours = getattr(mlx_lowmem.MlxEngine, name)
                self.extends(ours, getattr(self.original["MlxEngine"], name))
                self.assertTrue(inspect.iscoroutinefunction(ours))
        self.assertEqual(parameters(mlx_lowmem.MlxEngine.peak_memory_gb),
                         parameters(self.original["MlxEngine"].peak_memory_gb))

    def test_codec_class_attributes_and_methods_match(self) -> None:
        original = self.original["AdapterCodec"]
        for name in ["TYPESIZES", "COMPRESSION_LEVEL"]:
            self.assertEqual(getattr(mlx_lowmem.AdapterCodec, name), getattr(original, name))
        for name in ["digest", "encode", "decode", "dtype"]:
            with self.subTest(name):
                self.assertEqual(parameters(getattr(mlx_lowmem.AdapterCodec, name)),
                                 parameters(getattr(original, name)))

    def test_fuser_matches(self) -> None:
        self.assertEqual(parameters(mlx_lowmem.AdapterFuser.ensure_fused),
                         parameters(self.original["AdapterFuser"].ensure_fused))


class Errors(unittest.TestCase):
    def test_one_root_and_the_originals_builtins(self) -> None:
        builtin = {
            "ConfigError": ValueError,
            "LoadError": RuntimeError,
            "EngineClosedError": RuntimeError,
            "ConversationError": ValueError,
            "GenerationError": RuntimeError,
            "CodecError": ValueError,
            "AdapterError": ValueError,
            "FuseError": RuntimeError,
            "NotOfferedError": AttributeError,
            "NotLoadedError": AttributeError,
            "PeerTimeoutError": TimeoutError,
        }
        for name, base in builtin.items():
            with self.subTest(name):
                cls = getattr(mlx_lowmem, name)
                self.assertTrue(issubclass(cls, mlx_lowmem.MlxLowmemError))
                self.assertTrue(issubclass(cls, base))

    def test_help_reads(self) -> None:
        for obj in [mlx_lowmem, mlx_lowmem.MlxEngine, mlx_lowmem.AdapterCodec, mlx_lowmem.AdapterFuser,
                    mlx_lowmem.Tokenizer, mlx_lowmem.MlxEngine.generate]:
            with self.subTest(obj):
                self.assertGreater(len(inspect.getdoc(obj) or ""), 40)

    def test_links_mlx_0_32_2(self) -> None:
        self.assertEqual(mlx_lowmem.MLX_VERSION, "0.32.2")


if __name__ == "__main__":
    unittest.main()
