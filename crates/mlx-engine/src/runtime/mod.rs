//! The engine around a model: the worker thread that owns MLX, its
//! configuration, batched generation on copies of the prefix's cache, and
//! chunks run side by side on lanes.

pub(crate) mod adapters;
pub(crate) mod engine;
pub(crate) mod generate;
pub(crate) mod lanes;
pub(crate) mod options;
pub(crate) mod prefill;
pub(crate) mod prefix_disk;
pub(crate) mod serving;
