//! Batched MLX inference on a dedicated worker thread that owns the model,
//! computes the prompt cache of the shared prefix messages once, and runs
//! greedy generation (one token by default: classification) over many
//! conversations.
//!
//! Why: MLX is not thread-safe across threads sharing arrays, and most of a
//! classification prompt is a shared prefix worth computing once.
