"""Start time of cc-sentiment's classifier on our Python face with its
prefix (cc-sentiment 0.2.135's own prompt) computed cold against read from a
prefix cache folder, in both arithmetics.

Usage: prefix_start.py MODEL_DIR [--texts 8] [--warm 2]
                       [--arithmetics keep,dequantize_on_use]

Each start is a fresh process running cc-sentiment's `SentimentClassifier`
(see classify.py), with `MLX_LOWMEM_PREFIX_CACHE_DIR` naming a new folder for
each arithmetic (`MLX_LOWMEM_QUANTIZED=keep`, mlx_lm's packed products, and
`dequantize_on_use`): the first start computes the prefix and writes it,
the next `--warm` read it. Reported: load seconds (model + prefix), the
cold/warm ratio, peak RSS, and whether the labels of every start agree.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from classify import TEXTS, run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--warm", type=int, default=2)
    # One arithmetic alone where the other's cold start takes too long
    # (mlx_lm's packed products over E2B's widths: six minutes on a 2-core CPU).
    parser.add_argument("--arithmetics", default="keep,dequantize_on_use")
    args = parser.parse_args()
    texts = [TEXTS[i % len(TEXTS)] for i in range(args.texts)]
    print(f"model: {args.model}; cc-sentiment's prompt; {len(texts)} texts scored after each start")
    print("| arithmetic | cold load s | warm load s | cold / warm | peak RSS MB cold, warm | labels equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for quantized in args.arithmetics.split(","):
        with tempfile.TemporaryDirectory() as folder:
            env = {"MLX_LOWMEM_PREFIX_CACHE_DIR": folder, "MLX_LOWMEM_QUANTIZED": quantized}
            cold = run("ours", args.model, 2, texts, env)
            warm = [run("ours", args.model, 2, texts, env) for _ in range(args.warm)]
        warm_s = statistics.median(w["load_s"] for w in warm)
        same = all(w["labels"] == cold["labels"] for w in warm)
        rss = f"{cold['peak_rss_mb']:.0f}, {max(w['peak_rss_mb'] for w in warm):.0f}"
        print(f"| {quantized} | {cold['load_s']:.2f} | {warm_s:.2f} | {cold['load_s'] / warm_s:.1f}× | {rss} | {same} |",
              flush=True)


if __name__ == "__main__":
    main()
