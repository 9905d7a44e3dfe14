"""References for the Gemma 3 GGUF import (tests/gguf_gemma3.rs).

Usage:
  gguf_gemma3.py dequant GGUF OUT.safetensors NAME [NAME ...]
      The named tensors decoded by the `gguf` package (`gguf.quants.dequantize`),
      as float32, shaped as mlx_lm stores them (outermost first).
  gguf_gemma3.py tokens GGUF PROBES.json
      Token ids of each probe (a JSON list of strings) under the tokenizer
      transformers builds from the GGUF's vocabulary (its reference reading
      of such a file), without special tokens; prints a JSON list of lists.
  gguf_gemma3.py logits MODEL_DIR PROMPTS.json STEPS
      For each prompt (a JSON list of token-id lists), mlx_lm's last-position
      logits on the imported folder and its greedy continuation of STEPS
      tokens (stopping at EOS), under mlx_lm 0.32.2; prints {"version",
      "results": [{logits, continuation}, ...]}.
"""

import json
import os
import sys


def dequant(path, out, names):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFReader(path)
    wanted = set(names)
    arrays = {}
    for t in reader.tensors:
        if t.name in wanted:
            values = dequantize(t.data, t.tensor_type).astype(np.float32)
            shape = [int(d) for d in reversed(t.shape)]
            arrays[t.name] = np.ascontiguousarray(values.reshape(shape))
    missing = wanted - set(arrays)
    if missing:
        raise SystemExit(f"no tensors {sorted(missing)} in {path}")
    save_file(arrays, out)


def tokens(path, probes_path):
    # transformers' GGUF file reader needs torch; its tokenizer builders do
    # not. The metadata is read with the gguf package and handed to them
    # under the names transformers' own reader gives it.
    from gguf import GGUFReader
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = GGUFReader(path)
    tokenizer_dict = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        field = reader.fields.get(f"tokenizer.{key}")
        if field is not None:
            tokenizer_dict[name] = field.contents()
    architecture = reader.fields["general.architecture"].contents()
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    probes = json.load(open(probes_path, encoding="utf-8"))
    print(json.dumps([backend.encode(p, add_special_tokens=False).ids for p in probes]))


def logits(model_dir, prompts_path, steps):
    from pathlib import Path

    # mlx_lm 0.32.2 sits beside the venv's own when `cargo xtask test` put
    # it there.
    newer = Path(sys.prefix) / "mlx-lm-0.32.2"
    if newer.is_dir():
        sys.path.insert(0, str(newer))
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import load_model

    model, config = load_model(Path(model_dir))
    eos = config.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos])
    results = []
    for prompt in json.load(open(prompts_path)):
        ids = list(prompt)
        last = model(mx.array([ids]))[0, -1, :].astype(mx.float32)
        first = last.tolist()
        continuation = []
        for _ in range(steps):
            nxt = int(mx.argmax(last).item())
            if nxt in eos:
                break
            continuation.append(nxt)
            ids.append(nxt)
            last = model(mx.array([ids]))[0, -1, :].astype(mx.float32)
        results.append({"logits": first, "continuation": continuation})
    print(json.dumps({"version": mlx_lm.__version__, "results": results}))


def main():
    command = sys.argv[1]
    if command == "dequant":
        dequant(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif command == "tokens":
        tokens(sys.argv[2], sys.argv[3])
    elif command == "logits":
        logits(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
