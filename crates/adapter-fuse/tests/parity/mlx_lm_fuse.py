"""Reference fuse of one linear layer with mlx_lm's own LoRALinear.fuse.

Usage: mlx_lm_fuse.py BASE.safetensors ADAPTER.safetensors MODULE SCALE GROUP BITS OUT.safetensors
GROUP and BITS are 0 for a dense base. Writes the fused layer's parameters
under MODULE's names, as mlx_lm's fuse would save them.
"""
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.lora import LoRALinear

base_path, adapter_path, module, scale, group, bits, out_path = sys.argv[1:8]
scale, group, bits = float(scale), int(group), int(bits)
base = mx.load(base_path)
adapter = mx.load(adapter_path)
lora_a = adapter[module + ".lora_a"]
lora_b = adapter[module + ".lora_b"]
input_dims, rank = lora_a.shape
output_dims = lora_b.shape[1]
has_bias = module + ".bias" in base

if bits:
    linear = nn.QuantizedLinear(input_dims, output_dims, bias=has_bias, group_size=group, bits=bits)
    linear.scales = base[module + ".scales"]
    linear.biases = base[module + ".biases"]
else:
    linear = nn.Linear(input_dims, output_dims, bias=has_bias)
linear.weight = base[module + ".weight"]
if has_bias:
    linear.bias = base[module + ".bias"]

lora = LoRALinear.from_base(linear, r=rank, scale=scale)
lora.lora_a = lora_a
lora.lora_b = lora_b
fused = lora.fuse()
params = {module + "." + k: v for k, v in tree_flatten(fused.parameters())}
mx.save_safetensors(out_path, params)
