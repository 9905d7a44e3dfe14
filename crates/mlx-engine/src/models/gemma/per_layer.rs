//! Gemma 4's per-layer inputs: a table gathered per token and a
//! projection of the scaled embedding, a layer's columns at a time.

use mlx_rs::fast;
use mlx_rs::Array;

use crate::error::Result;
use crate::models::config::ModelConfig;
use crate::models::gemma::config::GemmaSpec;
use crate::models::gemma::ops::scalar;
use crate::weights::{Embedding, GatheredRows, Linear};

/// Gemma 4's per-layer embeddings: a table gathered per token and a
/// projection of the embedding, both `(B, L, layers · width)`.
pub(super) struct PerLayerInputs {
    pub(super) table: Embedding,
    pub(super) projection: Linear,
    pub(super) norm: Array,
}

/// What Gemma 4's per-layer inputs are computed from, for one forward:
/// the per-layer table's rows for its tokens, as the table holds them, and
/// the scaled token embedding.
pub(super) struct PerLayerSource {
    pub(super) rows: GatheredRows,
    pub(super) embedded: Array,
}

impl PerLayerInputs {
    /// Layer `i`'s per-layer input `(B, L, width)`: its columns of the
    /// table's rows scaled by `√width`, plus the normalised projection of
    /// the scaled embedding onto its outputs, the sum scaled by `2^-½`.
    ///
    /// A layer at a time: all layers' inputs at once are 35 × 256 wide for
    /// E2B, ~32 MB for a prefill of 8 rows of 113 tokens, and computing them
    /// held several such arrays at once (the prefill's highest point).
    /// Each element's arithmetic is the same either way.
    pub(super) fn of_layer(
        &self,
        c: &ModelConfig,
        spec: &GemmaSpec,
        i: usize,
        source: &PerLayerSource,
    ) -> Result<Array> {
        let width = spec.per_layer_dim;
        let columns = i * width..(i + 1) * width;
        let rows = source.rows.columns(columns.clone())?;
        let rows = rows.multiply(scalar((width as f64).sqrt(), rows.dtype())?)?;
        let projected = self.projection.forward_outputs(&source.embedded, columns)?;
        let projected = projected.multiply(scalar(
            (c.hidden_size as f64).powf(-0.5),
            projected.dtype(),
        )?)?;
        let projected = fast::rms_norm(&projected, Some(&self.norm), c.rms_norm_eps)?;
        let sum = projected.add(&rows)?;
        Ok(sum.multiply(scalar(0.5f64.sqrt(), sum.dtype())?)?)
    }
}
