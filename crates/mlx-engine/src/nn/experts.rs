//! A mixture-of-experts feed-forward block, as mlx_lm 0.32.2's
//! `Qwen3MoeSparseMoeBlock` and `SwitchGLU` compute it: a router's softmax
//! (in f32), the top-k experts of each position, their weights renormalised
//! when the config says so, each chosen expert's gated MLP through MLX's
//! `gather_mm` (rows sorted by expert once there are 64 or more choices,
//! as mlx_lm sorts them), and the experts' outputs summed by weight.

use mlx_rs::ops::indexing::{take_along_axis, IndexOp};
use mlx_rs::ops::{
    argpartition_axis, argsort_axis, expand_dims_axes, gather_mm, softmax_axis, sum_axis,
};
use mlx_rs::Array;

use crate::error::Result;
use crate::nn::fused::silu_mul;
use crate::weights::routed::RoutedStack;
use crate::weights::Linear;

/// The routed experts of one layer: stacked `(experts, out, in)` weights.
pub(crate) struct Experts {
    /// `(hidden → experts)`.
    pub router: Linear,
    pub weights: ExpertWeights,
    pub top_k: i32,
    /// Renormalise the chosen experts' weights to sum to one.
    pub norm_topk_prob: bool,
}

/// Where the experts' gate, up and down projections are.
pub(crate) enum ExpertWeights {
    /// In memory, each as `(experts, in, out)` (the stored `(experts, out,
    /// in)` transposed, as `gather_mm` takes it).
    Resident { gate: Array, up: Array, down: Array },
    /// Left in the files: a forward reads the experts its rows chose.
    InFiles {
        gate: RoutedStack,
        up: RoutedStack,
        down: RoutedStack,
    },
}

/// mlx_lm sorts the (row, expert) choices by expert from this many on.
const SORT_FROM: usize = 64;

impl Experts {
    /// The block's output for `x` `(B, L, hidden)`.
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let (chosen, weights) = self.route(x)?;
        let y = match &self.weights {
            ExpertWeights::Resident { gate, up, down } => {
                self.switch_glu(x, &chosen, [gate, up, down])?
            }
            ExpertWeights::InFiles { gate, up, down } => {
                // The distinct experts the rows chose, each read once; the
                // choices renumbered into the read stack keep their order,
                // so the products are those of the resident stack.
                let flat = chosen.contiguous()?;
                flat.eval()?;
                let ids: Vec<u32> = flat
                    .try_as_slice::<u32>()
                    .map_err(|e| mlx_rs::error::Exception::custom(format!("routed experts: {e}")))?
                    .to_vec();
                let mut distinct: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
                distinct.sort_unstable();
                distinct.dedup();
                let local: Vec<u32> = ids
                    .iter()
                    .map(|&e| distinct.partition_point(|&d| d < e as usize) as u32)
                    .collect();
                let local = Array::from_slice(&local, chosen.shape());
                let read = |stack: &RoutedStack| -> Result<Array> {
                    Ok(stack.read(&distinct)?.swap_axes(-1, -2)?)
                };
                let (gate, up, down) = (read(gate)?, read(up)?, read(down)?);
                self.switch_glu(x, &local, [&gate, &up, &down])?
            }
        };
        // (B, L, k, hidden) · (B, L, k, 1), summed over the k experts.
        let weighted = y.multiply(expand_dims_axes(&weights, &[-1])?)?;
        Ok(sum_axis(&weighted, -2, false)?.as_dtype(y.dtype())?)
    }

    /// Each position's `top_k` experts `(B, L, k)` and their weights.
    pub(crate) fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let logits = self.router.forward(x)?;
        let probs = softmax_axis(&logits, -1, true)?;
        let k = self.top_k;
        let chosen = argpartition_axis(&probs, -k, -1)?;
        let last = chosen.dim(-1);
        let chosen = chosen.index((.., .., last - k..));
        let mut weights = take_along_axis(&probs, &chosen, -1)?;
        if self.norm_topk_prob {
            weights = weights.divide(sum_axis(&weights, -1, true)?)?;
        }
        Ok((chosen, weights))
    }

    /// Each chosen expert's gated MLP on its row: `(B, L, k, hidden)`.
    fn switch_glu(
        &self,
        x: &Array,
        chosen: &Array,
        [gate, up, down]: [&Array; 3],
    ) -> Result<Array> {
        let (b, l, k) = (chosen.dim(0), chosen.dim(1), chosen.dim(2));
        let hidden = x.dim(-1);
        let rows = expand_dims_axes(x, &[-2, -3])?; // (B, L, 1, 1, hidden)
        let sorted = chosen.size() >= SORT_FROM;
        let (rows, idx, inverse) = if sorted {
            let flat = chosen.flatten(None, None)?;
            let order = argsort_axis(&flat, 0)?;
            let inverse = argsort_axis(&order, 0)?;
            // Row r's choices are entries r·k … r·k + k − 1 of `flat`.
            let source = order.floor_divide(Array::from_int(k))?;
            let rows = rows.reshape(&[b * l, 1, hidden])?.take_axis(&source, 0)?;
            (rows, flat.take_axis(&order, 0)?, Some(inverse))
        } else {
            (rows, chosen.clone(), None)
        };
        let product = |a: &Array, w: &Array| -> Result<Array> {
            Ok(gather_mm(a, w, None, Some(&idx), Some(sorted))?)
        };
        let up = product(&rows, up)?;
        let gate = product(&rows, gate)?;
        let down = product(&silu_mul(&gate, &up)?, down)?;
        let out = match inverse {
            // (B·L·k, 1, hidden) back to the choices' order and shape.
            Some(inverse) => down
                .take_axis(&inverse, 0)?
                .reshape(&[b, l, k, 1, hidden])?,
            None => down,
        };
        Ok(out.squeeze_axes(&[-2])?)
    }
}
