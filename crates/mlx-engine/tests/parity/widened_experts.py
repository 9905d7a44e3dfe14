"""mlx_lm's expert products widened to float32, for dense half-precision
mixtures of experts on the CPU.

MLX's CPU `gather_mm` multiplies float32 alone, so mlx_lm 0.32.2 cannot run
a dense bfloat16 or float16 qwen3_moe or mixtral there. With the request's
"widen_experts": true, `gather_mm` takes both operands widened to float32
and rounds its product back to the activations' dtype — the same arithmetic
as a half-precision `gather_mm` that sums in float32, and what the engine
does on the CPU — leaving every other operation in the checkpoint's dtype.
"""
import mlx.core as mx


def widen_if_asked(request):
    if not request.get("widen_experts"):
        return
    narrow = mx.gather_mm

    def widened(a, b, *args, **kwargs):
        product = narrow(a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs)
        return product.astype(a.dtype)

    mx.gather_mm = widened
