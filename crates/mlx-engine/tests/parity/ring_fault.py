"""A rank that joins an MLX ring and then misbehaves, for the engine's fault
tests: `exit` leaves at once (its sockets close), `stall` stays alive
without taking part (its sockets stay open)."""

import sys
import time

import mlx.core as mx

group = mx.distributed.init(strict=True, backend="ring")
print(f"joined as rank {group.rank()} of {group.size()}", flush=True)
if sys.argv[1] == "stall":
    time.sleep(120)
