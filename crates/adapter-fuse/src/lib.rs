//! Fuse a shipped LoRA adapter into a base model from the Hugging Face hub
//! (`W' = W + (scale·Bᵀ)@Aᵀ`, requantizing quantized bases) and keep the result
//! in the hub cache layout, keyed by the adapter's digest.
//!
//! Why: an application ships a small adapter, not a fused model, and pays the
//! fusing cost once per machine.
