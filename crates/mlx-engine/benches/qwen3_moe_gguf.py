"""The engine benchmark's 4-bit qwen3_moe folder written as a `qwen3moe` GGUF
for llama.cpp, with the same values.

MLX's affine 4-bit groups (`scale · q + bias`, groups of 64 along a row)
are llama.cpp's Q4_1 blocks (`d · q + m`, blocks of 32) with each group
split in two: the 4-bit values are copied as they are, and only the scales
and biases are rounded to float16 (Q4_1 stores them so). Norms and the
routers (dense f32 in the folder) stay f32. The tokenizer is copied from a
GGUF of the same vocabulary (SmolLM2's, which the folder's tokenizer is).

Usage: qwen3_moe_gguf.py MODEL_DIR VOCAB_GGUF OUT_GGUF
"""
import json
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

model_dir, vocab_gguf, out_path = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
config = json.loads((model_dir / "config.json").read_text())
group = config["quantization"]["group_size"]
assert config["quantization"]["bits"] == 4 and group % 32 == 0, config["quantization"]

arrays = {}
for f in sorted(model_dir.glob("*.safetensors")):
    arrays.update(mx.load(str(f)))


def q4_1(prefix):
    """`prefix`'s packed weight `(…, out, in / 8)` as Q4_1 blocks, bytes
    `(…, out, in / 32 · 20)`, converted a matrix at a time."""
    words = np.array(arrays[prefix + ".weight"])
    scales = np.array(arrays[prefix + ".scales"].astype(mx.float32))
    biases = np.array(arrays[prefix + ".biases"].astype(mx.float32))
    lead = words.shape[:-2]
    flat = words.reshape(-1, *words.shape[-2:])
    s_flat = scales.reshape(-1, *scales.shape[-2:])
    b_flat = biases.reshape(-1, *biases.shape[-2:])
    shifts = np.arange(8, dtype=np.uint32) * 4
    out = []
    for w, s, b in zip(flat, s_flat, b_flat):
        rows, width = w.shape
        # Value e of a word at bits 4e: column 8·word + e.
        q = ((w[..., None] >> shifts) & 15).astype(np.uint8).reshape(rows, width * 8 // 32, 32)
        qs = q[..., :16] | (q[..., 16:] << 4)
        per = group // 32
        d = np.repeat(s.astype(np.float16), per, axis=-1)[..., None].view(np.uint8)
        m = np.repeat(b.astype(np.float16), per, axis=-1)[..., None].view(np.uint8)
        out.append(np.concatenate([d, m, qs], axis=-1).reshape(rows, -1))
    return np.stack(out).reshape(*lead, *out[0].shape)


def f32(key):
    return np.array(arrays[key].astype(mx.float32))


arch = "qwen3moe"
writer = gguf.GGUFWriter(out_path, arch)
writer.add_block_count(config["num_hidden_layers"])
writer.add_context_length(config["max_position_embeddings"])
writer.add_embedding_length(config["hidden_size"])
writer.add_feed_forward_length(config["intermediate_size"])
writer.add_head_count(config["num_attention_heads"])
writer.add_head_count_kv(config["num_key_value_heads"])
writer.add_key_length(config["head_dim"])
writer.add_value_length(config["head_dim"])
writer.add_rope_freq_base(config["rope_theta"])
writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
writer.add_expert_count(config["num_experts"])
writer.add_expert_used_count(config["num_experts_per_tok"])
writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)

reader = gguf.GGUFReader(vocab_gguf)
for name, field in reader.fields.items():
    if not name.startswith("tokenizer."):
        continue
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        writer.add_key_value(name, field.contents(), gguf.GGUFValueType.ARRAY, field.types[-1])
    else:
        writer.add_key_value(name, field.contents(), field.types[0])

Q4_1 = gguf.GGMLQuantizationType.Q4_1
writer.add_tensor("token_embd.weight", q4_1("model.embed_tokens"), raw_dtype=Q4_1)
writer.add_tensor("output_norm.weight", f32("model.norm.weight"))
writer.add_tensor("output.weight", q4_1("lm_head"), raw_dtype=Q4_1)
for i in range(config["num_hidden_layers"]):
    layer, blk = f"model.layers.{i}", f"blk.{i}"
    writer.add_tensor(f"{blk}.attn_norm.weight", f32(f"{layer}.input_layernorm.weight"))
    writer.add_tensor(f"{blk}.ffn_norm.weight", f32(f"{layer}.post_attention_layernorm.weight"))
    for ours, theirs in [("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")]:
        writer.add_tensor(f"{blk}.attn_{theirs}.weight",
                          q4_1(f"{layer}.self_attn.{ours}_proj"), raw_dtype=Q4_1)
    for norm in ["q", "k"]:
        writer.add_tensor(f"{blk}.attn_{norm}_norm.weight", f32(f"{layer}.self_attn.{norm}_norm.weight"))
    writer.add_tensor(f"{blk}.ffn_gate_inp.weight", f32(f"{layer}.mlp.gate.weight"))
    for proj in ["gate", "up", "down"]:
        writer.add_tensor(f"{blk}.ffn_{proj}_exps.weight",
                          q4_1(f"{layer}.mlp.switch_mlp.{proj}_proj"), raw_dtype=Q4_1)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
print(out_path)
