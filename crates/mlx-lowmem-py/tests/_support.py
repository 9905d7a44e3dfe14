"""What the Python face's tests share: the fixtures they need (skipping,
saying so, without them), a safetensors reader and writer (numpy only, so
that the tests do not lean on the code under test), and a tiny llama."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import unittest
from pathlib import Path

import numpy as np

SMOLLM2 = os.environ.get("MLX_LOWMEM_SMOLLM2")

DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "U32": np.uint32}


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def smollm2(variant: str) -> Path:
    """The SmolLM2-135M-Instruct fixture (`cargo xtask fixtures`), or a skip."""
    if not SMOLLM2:
        raise unittest.SkipTest("MLX_LOWMEM_SMOLLM2 is not set (cargo xtask fixtures makes it)")
    return Path(SMOLLM2) / variant


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {}
    offset = 0
    names = {v: k for k, v in DTYPES.items()}
    for name, array in tensors.items():
        size = array.nbytes
        header[name] = {
            "dtype": names[array.dtype.type],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    return {
        k: (v["dtype"], v["shape"], body[v["data_offsets"][0] : v["data_offsets"][1]])
        for k, v in header.items()
        if k != "__metadata__"
    }


def model_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    out: dict[str, tuple[str, list[int], bytes]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(read_safetensors(file))
    return out


HIDDEN, LAYERS, INTERMEDIATE, HEADS, KV_HEADS = 64, 2, 128, 4, 2


def write_tiny_llama(folder: Path, tokenizer_from: Path, seed: int = 0) -> None:
    """A random two-layer llama (f32) with SmolLM2's tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(tokenizer_from / name, folder / name)
    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    head_dim = HIDDEN // HEADS
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, HIDDEN), "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
        }
    write_safetensors(folder / "model.safetensors", tensors)


def write_tiny_adapter(folder: Path, seed: int = 1) -> None:
    """An mlx_lm LoRA adapter (rank 4, q and v projections) for the tiny llama."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "fine_tune_type": "lora",
        "num_layers": LAYERS,
        "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    tensors = {}
    for i in range(LAYERS):
        for name, out in [("q_proj", HEADS * head_dim), ("v_proj", KV_HEADS * head_dim)]:
            p = f"model.layers.{i}.self_attn.{name}."
            tensors[p + "lora_a"] = (rng.standard_normal((HIDDEN, 4)) * 0.1).astype(np.float32)
            tensors[p + "lora_b"] = (rng.standard_normal((4, out)) * 0.1).astype(np.float32)
    write_safetensors(folder / "adapters.safetensors", tensors)


def into_hub_cache(cache: Path, repo: str, model: Path, revision: str = "0" * 40) -> None:
    """`model`'s files as the hub cache holds a downloaded snapshot of `repo`."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in model.iterdir():
        shutil.copy(file, snapshot / file.name)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(revision)


def run_python(code: str, env: dict[str, str]) -> str:
    """`code` in a fresh interpreter (this one) with `env` added; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise AssertionError(f"child Python failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout
