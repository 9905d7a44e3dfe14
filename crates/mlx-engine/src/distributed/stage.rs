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
//!
//! A receive must name its dtype, and what a stage's layers give depends on
//! the checkpoint and the arithmetic (a 4-bit table with bfloat16 scales
//! embeds in bfloat16; the CPU default's products then make float32). So
//! every array crosses a stage boundary after a one-number header with its
//! dtype, and the receiver takes exactly what the sender computed: the
//! next stage computes in the dtype the one-process model has there.

use std::ops::Range;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::zeros_dtype;
use mlx_rs::{Array, Dtype};
use mlx_support::distributed::Group;

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, host_slice, Why};

/// The dtypes that cross a stage boundary, by the code their header holds.
const DTYPES: [Dtype; 3] = [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16];

fn dtype_code(dtype: Dtype) -> Option<i32> {
    DTYPES.iter().position(|&d| d == dtype).map(|i| i as i32)
}

/// A rank's layers and its neighbours.
pub(crate) struct Stage {
    group: Group,
    layers: Range<usize>,
    total: usize,
}

impl Stage {
    /// The whole model in this process.
    pub(crate) fn whole(total: usize) -> Stage {
        Stage {
            group: Group::single(),
            layers: 0..total,
            total,
        }
    }

    /// Layers `layers` of `total` on this rank of `group`.
    pub(crate) fn part(group: Group, layers: Range<usize>, total: usize) -> Stage {
        Stage {
            group,
            layers,
            total,
        }
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
        let from = self.group.rank() - 1;
        let what = "receiving hidden states";
        (0..count)
            .map(|_| {
                let header = self
                    .group
                    .recv(&[1], Dtype::Int32, from)
                    .map_err(|e| self.err(what, e))?;
                evaluate(Why::Collective, [&header]).map_err(|e| self.err(what, e))?;
                let code = host_slice::<i32>(Why::Collective, "a transfer's header", &header)?[0];
                let dtype = usize::try_from(code)
                    .ok()
                    .and_then(|i| DTYPES.get(i).copied())
                    .ok_or_else(|| self.err(what, format!("rank {from} sent dtype code {code}")))?;
                let x = self
                    .group
                    .recv(&shape, dtype, from)
                    .map_err(|e| self.err(what, e))?;
                evaluate(Why::Collective, [&x]).map_err(|e| self.err(what, e))?;
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
        let what = "sending hidden states";
        let to = self.group.rank() + 1;
        for x in xs {
            let code = dtype_code(x.dtype())
                .ok_or_else(|| self.err(what, format!("cannot send {:?}", x.dtype())))?;
            // The header first, on its own: the receiver reads it before
            // it can name the hidden states' dtype.
            for array in [&Array::from_slice(&[code], &[1]), x] {
                let sent = self.group.send(array, to).map_err(|e| self.err(what, e))?;
                evaluate(Why::Collective, [&sent]).map_err(|e| self.err(what, e))?;
            }
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
        let what = "sharing the logits";
        let local = if self.is_last() { Some(head()?) } else { None };
        // Every rank must offer the same dtype to the all-gather: the last
        // stage's logits' own, which it announces first.
        let code = match &local {
            Some(logits) => dtype_code(logits.dtype())
                .ok_or_else(|| self.err(what, format!("cannot share {:?}", logits.dtype())))?,
            None => -1,
        };
        let codes = self
            .group
            .all_gather(&Array::from_slice(&[code], &[1]))
            .map_err(|e| self.err(what, e))?;
        evaluate(Why::Collective, [&codes]).map_err(|e| self.err(what, e))?;
        let last_code = host_slice::<i32>(Why::Collective, "the stages' dtypes", &codes)?
            .last()
            .copied()
            .unwrap_or(-1);
        let dtype = usize::try_from(last_code)
            .ok()
            .and_then(|i| DTYPES.get(i).copied())
            .ok_or_else(|| {
                self.err(
                    what,
                    format!("the last stage announced dtype code {last_code}"),
                )
            })?;
        let local = match local {
            Some(logits) => logits,
            None => {
                let mut shape = x.shape().to_vec();
                if let Some(last) = shape.last_mut() {
                    *last = vocab as i32;
                }
                zeros_dtype(&shape, dtype)?
            }
        };
        let all = self
            .group
            .all_gather(&local)
            .map_err(|e| self.err(what, e))?;
        evaluate(Why::Collective, [&all]).map_err(|e| self.err(what, e))?;
        let rows = x.dim(0);
        let last = (self.group.size() as i32 - 1) * rows;
        Ok(all.index(last..last + rows))
    }
}
