"""The `collectives` mode of examples/ring_rank.rs in Python's mlx, so that a
Rust rank and a Python rank can form one MLX job (MLX_RANK / MLX_HOSTFILE
from the environment)."""

import json

import mlx.core as mx

group = mx.distributed.init(strict=True, backend="ring")
rank = group.rank()
r = float(rank + 1)
# Each collective is evaluated before the next is made, in the Rust rank's order.
total = mx.distributed.all_sum(mx.array([r, 2 * r], dtype=mx.float32), group=group)
mx.eval(total)
gathered = mx.distributed.all_gather(mx.array([float(rank)], dtype=mx.float32), group=group)
mx.eval(gathered)
if rank == 0:
    mx.eval(mx.distributed.send(mx.array([1.5, 2.5], dtype=mx.float32), 1, group=group))
    got = mx.distributed.recv((3,), mx.int32, 1, group=group)
    mx.eval(got)
else:
    got = mx.distributed.recv((2,), mx.float32, 0, group=group)
    mx.eval(got)
    mx.eval(mx.distributed.send(mx.array([7, 8, 9], dtype=mx.int32), 0, group=group))
print(
    "RESULT "
    + json.dumps(
        {
            "rank": rank,
            "size": group.size(),
            "all_sum": total.tolist(),
            "all_gather": gathered.tolist(),
            "exchanged": [float(v) for v in got.tolist()],
        }
    )
)
