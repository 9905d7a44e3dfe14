//! One rank's part of a pipeline: which decoder layers it holds, and how a
//! forward's hidden states enter and leave it.
//!
//! The first stage embeds the tokens; every other stage receives the
//! previous stage's hidden states instead. Every stage but the last sends
//! its output on. The last stage alone holds the final norm and the output
//! projection; its logits reach every rank (an all-gather in which the
//! other ranks contribute zeros and only the last rank's block is kept),
//! so that every rank picks the same tokens and runs the same next step.
//!
//! Every exchange is evaluated where it is made, in the order of the
//! forwards: MLX pairs a receive with the peer's send by their order on the
//! socket, and a lazy graph holding several would evaluate them in an
//! order of its own.

use std::ops::Range;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::zeros_dtype;
use mlx_rs::{Array, Dtype};
use mlx_support::distributed::Group;

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, Why};

/// A rank's layers and its neighbours.
pub(crate) struct Stage {
    group: Group,
    layers: Range<usize>,
    total: usize,
    /// The hidden states' dtype (what the first stage's embedding gives),
    /// known to every stage after the load's handshake.
    hidden_dtype: Dtype,
}

impl Stage {
    /// The whole model in this process.
    pub(crate) fn whole(total: usize) -> Stage {
        Stage {
            group: Group::single(),
            layers: 0..total,
            total,
            hidden_dtype: Dtype::Float32,
        }
    }

    /// Layers `layers` of `total` on this rank of `group`.
    pub(crate) fn part(group: Group, layers: Range<usize>, total: usize) -> Stage {
        Stage {
            group,
            layers,
            total,
            hidden_dtype: Dtype::Float32,
        }
    }

    pub(crate) fn set_hidden_dtype(&mut self, dtype: Dtype) {
        self.hidden_dtype = dtype;
    }

    /// The decoder layers this rank holds (indices in the model).
    pub(crate) fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Whether this stage embeds the tokens.
    pub(crate) fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    /// Whether this stage computes the logits.
    pub(crate) fn is_last(&self) -> bool {
        self.layers.end == self.total
    }

    /// Whether the model is split over several ranks.
    pub(crate) fn is_split(&self) -> bool {
        !(self.is_first() && self.is_last())
    }

    fn err(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::Distributed {
            rank: self.group.rank(),
            message: format!("{what}: {e}"),
        }
    }

    /// A forward's input `(B, L, hidden)` for `tokens` `(B, L)`: `embed`
    /// on the first stage, the previous stage's output elsewhere.
    pub(crate) fn input(
        &self,
        tokens: &Array,
        hidden: usize,
        embed: impl FnOnce() -> Result<Array>,
    ) -> Result<Array> {
        let mut x = self.inputs(tokens, hidden, 1, || Ok(vec![embed()?]))?;
        Ok(x.remove(0))
    }

    /// [`input`](Self::input) of `count` arrays of the same shape (what a
    /// decoder carries from layer to layer besides the hidden state, e.g.
    /// Gemma 4's scaled embedding, which its per-layer inputs read).
    pub(crate) fn inputs(
        &self,
        tokens: &Array,
        hidden: usize,
        count: usize,
        embed: impl FnOnce() -> Result<Vec<Array>>,
    ) -> Result<Vec<Array>> {
        if self.is_first() {
            return embed();
        }
        let shape = [tokens.dim(0), tokens.dim(1), hidden as i32];
        (0..count)
            .map(|_| {
                let x = self
                    .group
                    .recv(&shape, self.hidden_dtype, self.group.rank() - 1)
                    .map_err(|e| self.err("receiving hidden states", e))?;
                evaluate(Why::Collective, [&x])
                    .map_err(|e| self.err("receiving hidden states", e))?;
                Ok(x)
            })
            .collect()
    }

    /// Hands a forward's output to the next stage (evaluating it); the
    /// last stage keeps it.
    pub(crate) fn output(&self, x: &Array) -> Result<()> {
        self.outputs(std::slice::from_ref(x))
    }

    /// [`output`](Self::output) of what [`inputs`](Self::inputs) receives.
    pub(crate) fn outputs(&self, xs: &[Array]) -> Result<()> {
        if self.is_last() {
            return Ok(());
        }
        for x in xs {
            let sent = self
                .group
                .send(x, self.group.rank() + 1)
                .map_err(|e| self.err("sending hidden states", e))?;
            evaluate(Why::Collective, [&sent]).map_err(|e| self.err("sending hidden states", e))?;
        }
        Ok(())
    }

    /// The logits of hidden states `x` `(…, hidden)` on every rank: `head`
    /// on the last stage, received from it elsewhere. The last stage's
    /// logits come back unchanged (an all-gather copies bytes).
    pub(crate) fn logits(
        &self,
        x: &Array,
        vocab: usize,
        head: impl FnOnce() -> Result<Array>,
    ) -> Result<Array> {
        if !self.is_split() {
            return head();
        }
        let local = if self.is_last() {
            head()?
        } else {
            let mut shape = x.shape().to_vec();
            if let Some(last) = shape.last_mut() {
                *last = vocab as i32;
            }
            zeros_dtype(&shape, x.dtype())?
        };
        // Every rank must offer the same dtype; the last stage's logits
        // have its hidden states' dtype.
        let local = if local.dtype() == x.dtype() {
            local
        } else {
            local.as_dtype(x.dtype())?
        };
        let all = self
            .group
            .all_gather(&local)
            .map_err(|e| self.err("sharing the logits", e))?;
        evaluate(Why::Collective, [&all]).map_err(|e| self.err("sharing the logits", e))?;
        let rows = x.dim(0);
        let last = (self.group.size() as i32 - 1) * rows;
        Ok(all.index(last..last + rows))
    }
}
