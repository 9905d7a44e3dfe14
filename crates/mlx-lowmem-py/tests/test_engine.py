"""`MlxEngine` on SmolLM2-135M-Instruct (4-bit): answers, order, progress on
the event loop, the GIL released while MLX works, the logits processor
called as mlx_lm calls it, jobs on the worker, and each failure as a typed
exception. Skips, saying so, without the fixture."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import unittest
from pathlib import Path

import mlx_lowmem
import json

import numpy as np
from _support import has, run_python, smollm2, write_safetensors

PREFIX = [{"role": "system", "content": "Rate how positive the message is, from 1 to 5. Answer with one digit."}]
TEXTS = ["great work, thanks!", "this is broken again", "ok", "the build fails", "perfect", "meh"]


def conversations(texts=TEXTS):
    return [PREFIX + [{"role": "user", "content": t}] for t in texts]


def digits_only(seen: dict):
    """A factory like cc-sentiment's: only the tokens "1".."5" may win."""

    def factory(tokenizer):
        seen["tokenizer"] = tokenizer
        allowed = [tokenizer.encode(str(n), add_special_tokens=False)[-1] for n in range(1, 6)]
        seen["allowed"] = allowed

        def processor(tokens, logits):
            seen.setdefault("types", set()).add(type(logits).__module__.split(".")[0])
            seen.setdefault("shapes", set()).add(tuple(logits.shape))
            seen["thread"] = threading.get_native_id()
            if has("mlx"):
                import mlx.core as mx

                mask = mx.full(logits.shape, -1e9)
                mask[..., mx.array(allowed)] = logits[..., mx.array(allowed)]
                return mask
            import numpy as np

            mask = np.full(logits.shape, -1e9, dtype=np.float32)
            mask[..., allowed] = logits[..., allowed]
            return mask

        return processor

    return factory


def engine(seen: dict | None = None, **options) -> mlx_lowmem.MlxEngine:
    options.setdefault("quantized", "dequantize_on_use")
    return mlx_lowmem.MlxEngine(
        smollm2("q4"),
        logits_processor_factory=digits_only({} if seen is None else seen),
        prefix_messages=PREFIX,
        batch_size=2,
        **options,
    )


class Generation(unittest.IsolatedAsyncioTestCase):
    async def test_answers_in_order_with_progress_on_the_loop_and_the_loop_free(self) -> None:
        seen: dict = {}
        e = engine(seen)
        await e.ensure_loaded()
        loop_thread = threading.get_native_id()
        progress: list[tuple[int, int]] = []
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        texts = await e.generate(conversations(), lambda n: progress.append((n, threading.get_native_id())))
        task.cancel()
        # Each text alone gives the same answer (order kept, no row mixing).
        alone = [(await e.generate(conversations([t]), lambda n: None))[0] for t in TEXTS]
        await e.close()
        self.assertEqual(texts, alone)
        self.assertTrue(all(t in {"1", "2", "3", "4", "5"} for t in texts), texts)
        self.assertEqual(sum(n for n, _ in progress), len(TEXTS))
        self.assertEqual({t for _, t in progress}, {loop_thread}, "on_progress runs on the event loop's thread")
        self.assertGreater(ticks, 10, "the event loop kept running while the engine worked")
        self.assertNotEqual(seen["thread"], loop_thread, "the processor runs on the worker")
        self.assertEqual(seen["shapes"], {(1, 49152)}, "one row at a time, as mlx_lm calls processors")
        self.assertEqual(seen["types"], {"mlx"} if has("mlx") else {"numpy"})

    async def test_the_worker_runs_jobs_and_knows_the_prefix(self) -> None:
        e = engine()
        await e.ensure_loaded()
        first = await e.submit(threading.get_native_id)
        second = await e.submit(threading.get_native_id)
        self.assertEqual(first, second)
        self.assertNotEqual(first, threading.get_native_id())
        self.assertEqual(await e.submit(lambda a, b: a * b, 6, 7), 42)
        with self.assertRaises(ZeroDivisionError):
            await e.submit(lambda: 1 / 0)
        template = e.tokenizer.apply_chat_template(PREFIX, tokenize=True, add_generation_prompt=False)
        self.assertEqual(e.prefix_tokens, template)
        self.assertIsNotNone(e.logit_processor)
        self.assertGreater(e.peak_memory_gb(), 0.05)
        await e.close()

    async def test_default_arithmetic_is_mlx_lms(self) -> None:
        # quantized="keep" (the default): packed products, as mlx_lm; the
        # answers agree with unpacking on this model and prompt.
        keep = mlx_lowmem.MlxEngine(smollm2("q4"), logits_processor_factory=digits_only({}),
                                    prefix_messages=PREFIX, batch_size=2)
        await keep.ensure_loaded()
        kept = await keep.generate(conversations(TEXTS[:2]), lambda n: None)
        await keep.close()
        self.assertTrue(all(t in {"1", "2", "3", "4", "5"} for t in kept), kept)


class PrefixCacheDir(unittest.IsolatedAsyncioTestCase):
    async def test_a_later_engine_reads_the_prefix_from_the_folder(self) -> None:
        # cc-sentiment's shape: the prefix's cache holds the token its
        # processor picks after it; the folder keeps the state that token is
        # picked from, so the second engine starts from the file.
        with tempfile.TemporaryDirectory() as work:
            folder = Path(work) / "prefixes"

            async def answers(**options) -> list[str]:
                e = engine(**options)
                await e.ensure_loaded()
                texts = await e.generate(conversations(), lambda n: None)
                await e.close()
                return texts

            without = await answers()
            first = await answers(prefix_cache_dir=folder)
            self.assertEqual(first, without)
            # The prefix, and the prefix with the processor's token fed after
            # it: the second engine runs neither pass.
            stored = sorted(folder.iterdir())
            self.assertEqual(len(stored), 2, stored)
            written = [path.stat().st_ino for path in stored]
            second = await answers(prefix_cache_dir=str(folder), prefix_cache_max_bytes=1 << 30)
            self.assertEqual(second, first)
            self.assertEqual(sorted(folder.iterdir()), stored)
            self.assertEqual([path.stat().st_ino for path in stored], written,
                             "read, not computed and written again")

            # An application that builds its engine itself: the environment.
            code = (
                "import asyncio, mlx_lowmem\n"
                f"e = mlx_lowmem.MlxEngine({str(smollm2('q4'))!r}, logits_processor_factory=None,\n"
                f"    prefix_messages={PREFIX!r}, batch_size=2, quantized='dequantize_on_use')\n"
                "asyncio.run(e.ensure_loaded())\n"
            )
            other = Path(work) / "from-env"
            run_python(code, {"MLX_LOWMEM_PREFIX_CACHE_DIR": str(other)})
            self.assertEqual(len(list(other.iterdir())), 2)


def write_adapter(folder: Path, seed: int) -> None:
    """A random mlx_lm adapter on SmolLM2's q and v projections of every
    other layer, strong enough to change greedy answers."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(0, 30, 2):
        for module, out in (("q_proj", 576), ("v_proj", 192)):
            key = f"model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_a"] = rng.normal(0, 0.03, (576, 4)).astype(np.float32)
            tensors[f"{key}.lora_b"] = rng.normal(0, 0.03, (4, out)).astype(np.float32)
    folder.mkdir(parents=True)
    write_safetensors(folder / "adapters.safetensors", tensors)
    config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 4, "scale": 64.0, "dropout": 0.0}}
    (folder / "adapter_config.json").write_text(json.dumps(config))


class Adapters(unittest.IsolatedAsyncioTestCase):
    async def test_a_call_picks_an_adapter_and_the_base_answers_as_without_adapters(self) -> None:
        # Several classifiers on one copy of the base: a call names its
        # adapter; calls without one answer as an engine without adapters.
        with tempfile.TemporaryDirectory() as work:
            x = Path(work) / "x"
            write_adapter(x, 1)

            def make(**options) -> mlx_lowmem.MlxEngine:
                return mlx_lowmem.MlxEngine(smollm2("q4"), logits_processor_factory=None, prefix_messages=PREFIX,
                                            batch_size=2, quantized="dequantize_on_use", **options)

            async def answers(e: mlx_lowmem.MlxEngine, **options) -> list[str]:
                return await e.generate(conversations(), lambda n: None, max_tokens=6, **options)

            plain = make()
            await plain.ensure_loaded()
            base = await answers(plain)
            await plain.close()

            e = make(adapters={"x": x})
            await e.ensure_loaded()
            self.assertEqual(await answers(e), base)
            adapted = await answers(e, adapter="x")
            self.assertNotEqual(adapted, base)
            self.assertEqual(await answers(e, adapter="x"), adapted, "its prefix kept, the same answers")
            with self.assertRaises(mlx_lowmem.ConfigError) as raised:
                await answers(e, adapter="z")
            self.assertIn("z", str(raised.exception))
            await e.close()

    async def test_adapters_load_and_unload_while_the_engine_runs(self) -> None:
        # Loaded later, an adapter answers as the same adapter given at the
        # start; unloaded, it is unknown again; one that fits no layer is
        # refused, naming it.
        with tempfile.TemporaryDirectory() as work:
            x = Path(work) / "x"
            write_adapter(x, 1)

            def make(**options) -> mlx_lowmem.MlxEngine:
                return mlx_lowmem.MlxEngine(smollm2("q4"), logits_processor_factory=None, prefix_messages=PREFIX,
                                            batch_size=2, quantized="dequantize_on_use", **options)

            async def answers(e: mlx_lowmem.MlxEngine, **options) -> list[str]:
                return await e.generate(conversations(), lambda n: None, max_tokens=6, **options)

            at_start = make(adapters={"x": x})
            await at_start.ensure_loaded()
            expected = await answers(at_start, adapter="x")
            await at_start.close()

            e = make()
            await e.ensure_loaded()
            base = await answers(e)
            self.assertEqual(await e.adapters(), [])
            await e.load_adapter("x", x)
            self.assertEqual(await e.adapters(), ["x"])
            self.assertEqual(await answers(e, adapter="x"), expected)
            self.assertNotEqual(expected, base)
            with self.assertRaises(mlx_lowmem.AdapterError) as raised:
                await e.load_adapter("x", x)
            self.assertIn("served already", str(raised.exception))
            # The same adapter as the codec ships it: a folder with the .zst.
            shipped = Path(work) / "shipped"
            shipped.mkdir()
            (shipped / "adapter_config.json").write_text((x / "adapter_config.json").read_text())
            mlx_lowmem._native.codec_encode(str(shipped / "adapters.safetensors.zst"),
                                            str(shipped / "adapter_config.json"),
                                            str(x / "adapters.safetensors"), 3)
            await e.load_adapter("shipped", shipped)
            self.assertEqual(await answers(e, adapter="shipped"), expected)
            await e.unload_adapter("shipped")
            with self.assertRaises(mlx_lowmem.ConfigError):
                await e.load_adapter("a:b", x)
            bad = Path(work) / "bad"
            bad.mkdir()
            (bad / "adapter_config.json").write_text((x / "adapter_config.json").read_text())
            write_safetensors(bad / "adapters.safetensors", {
                "model.layers.0.self_attn.q_norm.lora_a": np.zeros((576, 4), np.float32),
                "model.layers.0.self_attn.q_norm.lora_b": np.zeros((4, 576), np.float32),
            })
            with self.assertRaises(mlx_lowmem.AdapterError) as raised:
                await e.load_adapter("bad", bad)
            self.assertIn("model.layers.0.self_attn.q_norm", str(raised.exception))
            await e.unload_adapter("x")
            self.assertEqual(await e.adapters(), [])
            with self.assertRaises(mlx_lowmem.ConfigError):
                await answers(e, adapter="x")
            self.assertEqual(await answers(e), base)
            await e.close()


class SpawnllmMlxBackend(unittest.IsolatedAsyncioTestCase):
    @unittest.skipUnless(has("spawnllm"), "spawnllm is not installed here")
    async def test_spawnllms_own_backend_runs_on_the_face_unchanged(self) -> None:
        # spawnllm 0.17.1's `MlxBackend(engine=...)`, as its users build it:
        # no prefix, one user message per call, greedy.
        from spawnllm.backends.mlx import MlxBackend
        from spawnllm.spec import RunSpec

        e = mlx_lowmem.MlxEngine(smollm2("q4"), logits_processor_factory=None, prefix_messages=[],
                                 batch_size=2, quantized="dequantize_on_use")
        backend = MlxBackend(engine=e, max_tokens=12)
        prompt = "Name one colour of the sky."
        response = await backend.aexecute(RunSpec(prompt=prompt, model="local"))
        direct = await e.generate([[{"role": "user", "content": prompt}]], lambda n: None, max_tokens=12)
        await e.close()
        self.assertIsNone(response.error)
        self.assertEqual(response.result.raw, direct[0])
        self.assertTrue(direct[0].strip(), "something was generated")


class UnderAnyio(unittest.TestCase):
    @unittest.skipUnless(has("anyio"), "anyio is not installed here")
    def test_awaits_under_anyio_as_cc_sentiment_runs_them(self) -> None:
        import anyio

        async def main() -> list[str]:
            e = engine()
            await e.ensure_loaded()
            texts = await e.generate(conversations(TEXTS[:2]), lambda n: None)
            await e.close()
            return texts

        texts = anyio.run(main)
        self.assertEqual(len(texts), 2)
        self.assertTrue(all(t in {"1", "2", "3", "4", "5"} for t in texts), texts)


class Failures(unittest.IsolatedAsyncioTestCase):
    async def test_a_closed_engine_raises_at_once(self) -> None:
        e = engine()
        await e.ensure_loaded()
        await e.close()
        with self.assertRaises(mlx_lowmem.EngineClosedError) as raised:
            await e.generate(conversations(["x"]), lambda n: None)
        self.assertIsInstance(raised.exception, RuntimeError)
        with self.assertRaises(mlx_lowmem.EngineClosedError):
            await e.submit(print)

    async def test_the_processors_own_exception_reaches_the_caller(self) -> None:
        def factory(tokenizer):
            def processor(tokens, logits):
                raise KeyError("label table missing")

            return processor

        e = mlx_lowmem.MlxEngine(smollm2("q4"), logits_processor_factory=factory, prefix_messages=PREFIX,
                                 batch_size=2, quantized="dequantize_on_use", prefix_cache="clean")
        await e.ensure_loaded()
        with self.assertRaises(KeyError):
            await e.generate(conversations(["x"]), lambda n: None)
        await e.close()

    async def test_a_failing_factory_fails_the_load_every_time(self) -> None:
        def factory(tokenizer):
            raise ValueError("no labels for this tokenizer")

        e = mlx_lowmem.MlxEngine(smollm2("q4"), logits_processor_factory=factory, prefix_messages=PREFIX,
                                 batch_size=2, quantized="dequantize_on_use")
        for _ in range(2):
            with self.assertRaisesRegex(ValueError, "no labels"):
                await e.ensure_loaded()
        await e.close()

    async def test_bad_input_is_a_typed_error_naming_it(self) -> None:
        with self.assertRaisesRegex(mlx_lowmem.ConfigError, "memory='everywhere'"):
            engine(memory="everywhere")
        e = engine()
        await e.ensure_loaded()
        with self.assertRaisesRegex(mlx_lowmem.ConversationError, "conversation 1"):
            await e.generate([conversations(["x"])[0], [{"role": "user", "content": "no prefix"}]], lambda n: None)
        with self.assertRaisesRegex(mlx_lowmem.ConversationError, "conversation 0, message 1"):
            await e.generate([PREFIX + [{"role": "user"}]], lambda n: None)
        # The engine still serves after bad requests.
        self.assertEqual(len(await e.generate(conversations(["ok"]), lambda n: None)), 1)
        await e.close()

    async def test_a_missing_model_fails_the_load_naming_the_folder(self) -> None:
        e = mlx_lowmem.MlxEngine("/nonexistent/model", logits_processor_factory=None, prefix_messages=[],
                                 batch_size=1)
        with self.assertRaisesRegex(mlx_lowmem.LoadError, "/nonexistent/model"):
            await e.ensure_loaded()
        with self.assertRaises(mlx_lowmem.NotLoadedError):
            e.tokenizer  # noqa: B018
        await e.close()


class Tokenizer(unittest.IsolatedAsyncioTestCase):
    async def test_answers_as_mlx_lms_tokenizer_wrapper(self) -> None:
        if not has("mlx_lm"):
            self.skipTest("mlx_lm is not installed here")
        from mlx_lm.utils import load_tokenizer

        folder = smollm2("f32")
        theirs = load_tokenizer(folder)
        e = mlx_lowmem.MlxEngine(folder, logits_processor_factory=None, prefix_messages=PREFIX, batch_size=1)
        await e.ensure_loaded()
        ours = e.tokenizer
        text = "Rate this: 'it works' — 5/5 ✓"
        for special in [True, False]:
            self.assertEqual(ours.encode(text, add_special_tokens=special),
                             list(theirs.encode(text, add_special_tokens=special)))
        ids = theirs.encode(text)
        self.assertEqual(ours.decode(ids), theirs.decode(ids))
        messages = conversations(["hello"])[0]
        for prompt in [True, False]:
            self.assertEqual(ours.apply_chat_template(messages, add_generation_prompt=prompt),
                             list(theirs.apply_chat_template(messages, add_generation_prompt=prompt)))
            self.assertEqual(ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt),
                             theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))
        self.assertEqual(ours.eos_token_id, theirs.eos_token_id)
        self.assertEqual(ours.vocab_size, theirs.vocab_size)
        self.assertEqual(len(ours), len(theirs._tokenizer))
        await e.close()


class WhatIsNotOurs(unittest.IsolatedAsyncioTestCase):
    async def test_model_and_base_cache_are_mlx_lms_or_a_clear_error(self) -> None:
        e = engine()
        await e.ensure_loaded()
        if has("mlx_lm"):
            import mlx.nn

            self.assertIsInstance(e.model, mlx.nn.Module)
            # The original's cache: the prefix and the token generated after it.
            self.assertEqual(e.base_cache[0].offset, len(e.prefix_tokens) + 1)
        else:
            with self.assertRaisesRegex(mlx_lowmem.NotOfferedError, "mlx-lm") as raised:
                e.model  # noqa: B018
            self.assertIsInstance(raised.exception, AttributeError)
        await e.close()


if __name__ == "__main__":
    unittest.main()
