"""The Python original's side of `cargo xtask bench stream`.

One forward pass through the bench's synthetic safetensors model, with the
same per-block computation as `demo::synthetic::Block::forward`, in one of
two modes:

- `arsenal`: mlx-arsenal 0.17.0's `BlockStreamer.bind(block, i,
  evict_previous=i - 1)`, then the block's forward, `mx.eval` and
  `mx.clear_cache()` per block (the pattern its documentation gives);
- `python-all-loaded`: every block's weights loaded with `mx.load` into its
  own module and evaluated, all in one `mx.eval`, before the pass.

Usage: arsenal_stream.py MODE PATH ROWS
Prints: MODE BIND_S TOTAL_S PEAK_RSS_BYTES CHECKSUM (the Rust child's format).
"""

import resource
import sys
import time

import mlx.core as mx
import mlx.nn as nn

PREFIX = "transformer.transformer_blocks."
EMBED = "transformer.embed.weight"


class Weight(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = mx.zeros(shape)


class Attn(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.q = Weight((h, h))
        self.k = Weight((h, h))
        self.v = Weight((h, h))
        self.o = Weight((h, h))


class Mlp(nn.Module):
    def __init__(self, h, m):
        super().__init__()
        self.up = Weight((m, h))
        self.down = Weight((h, m))


class Block(nn.Module):
    def __init__(self, h, m):
        super().__init__()
        self.attn = Attn(h)
        self.mlp = Mlp(h, m)
        self.norm = Weight((h,))

    def __call__(self, x):
        h = mx.fast.rms_norm(x, self.norm.weight, 1e-5)
        q = h @ self.attn.q.weight.T
        k = h @ self.attn.k.weight.T
        v = h @ self.attn.v.weight.T
        x = x + (q * k + v) @ self.attn.o.weight.T
        up = mx.maximum(x @ self.mlp.up.weight.T, 0.0)
        return x + up @ self.mlp.down.weight.T


def peak_rss_bytes():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def main():
    mode, path, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "arsenal":
        # Before the clock starts: importing the package (numpy and its
        # other modules) takes 0.2-0.5 s, none of it streaming, and the
        # Rust side's figure has no counterpart of it.
        from mlx_arsenal.streaming import BlockStreamer
    start = time.perf_counter()
    bind_s = 0.0
    if mode == "arsenal":
        streamer = BlockStreamer(path, PREFIX)
        # The non-block parameters stay resident, as in the Rust pass.
        embed = streamer._weights[EMBED]
        x = embed[:rows]
        mx.eval(embed, x)
        hidden = embed.shape[1]
        mlp = streamer._weights[f"{PREFIX}0.mlp.up.weight"].shape[0]
        block = Block(hidden, mlp)
        for i in range(streamer.block_count):
            t = time.perf_counter()
            streamer.bind(block, i, evict_previous=i - 1 if i > 0 else None)
            bind_s += time.perf_counter() - t
            x = block(x)
            mx.eval(x)
            mx.clear_cache()
    elif mode == "python-all-loaded":
        weights = mx.load(path)
        embed = weights.pop(EMBED)
        x = embed[:rows]
        mx.eval(embed, x)
        count = 1 + max(int(k[len(PREFIX) :].split(".")[0]) for k in weights)
        hidden = embed.shape[1]
        mlp = weights[f"{PREFIX}0.mlp.up.weight"].shape[0]
        t = time.perf_counter()
        blocks = []
        for i in range(count):
            block = Block(hidden, mlp)
            own = f"{PREFIX}{i}."
            block.load_weights(
                [(k[len(own) :], v) for k, v in weights.items() if k.startswith(own)],
                strict=True,
            )
            blocks.append(block)
        # One evaluation of every weight, as mlx_lm's model loading does.
        mx.eval([block.parameters() for block in blocks])
        del weights
        bind_s = time.perf_counter() - t
        for block in blocks:
            x = block(x)
            mx.eval(x)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    checksum = x.sum()
    mx.eval(checksum)
    total_s = time.perf_counter() - start
    print(f"{mode} {bind_s} {total_s} {peak_rss_bytes()} {checksum.item()}")


if __name__ == "__main__":
    main()
