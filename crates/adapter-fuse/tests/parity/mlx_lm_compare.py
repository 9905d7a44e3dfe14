"""Loads two fused model folders with mlx_lm and compares them.

Usage: mlx_lm_compare.py OURS THEIRS
Prints one line: the number of weights that differ in any bit, and the
largest absolute difference of the last-position logits on a fixed prompt.
"""
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

ours, _ = load_model(Path(sys.argv[1]))
theirs, _ = load_model(Path(sys.argv[2]))
a = dict(tree_flatten(ours.parameters()))
b = dict(tree_flatten(theirs.parameters()))
assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
differing = sum(1 for k in a if not mx.array_equal(a[k], b[k]).item())
tokens = mx.array([[1, 5, 7, 9, 11, 2]])
diff = mx.abs(ours(tokens)[:, -1, :] - theirs(tokens)[:, -1, :]).max().item()
print(differing, diff)
