//! A mixture-of-experts feed-forward block, as mlx_lm 0.32.2's
//! `Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock` and `SwitchGLU`
//! compute it: the router's choice of each position's top-k experts and
//! their weights (see [`Routing`]), each chosen expert's gated MLP through MLX's
//! `gather_mm` (`gather_qmm` for experts multiplied packed; rows sorted by expert once there are 64 or more choices,
//! as mlx_lm sorts them), and the experts' outputs summed by weight.

use mlx_rs::ops::indexing::{take_along_axis, IndexOp};
use mlx_rs::ops::{argpartition_axis, argsort_axis, expand_dims_axes, softmax_axis, sum_axis};
use mlx_rs::Array;

use crate::error::Result;
use crate::nn::fused::silu_mul;
use crate::weights::routed::ExpertStack;
use crate::weights::Linear;

/// The routed experts of one layer: stacked `(experts, out, in)` weights.
pub(crate) struct Experts {
    /// `(hidden → experts)`.
    pub router: Linear,
    /// The gate, up and down projections.
    pub stacks: [ExpertStack; 3],
    pub top_k: i32,
    pub routing: Routing,
}

/// How the router's logits choose the experts and weigh them.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Routing {
    /// qwen3_moe: a softmax over every expert, its top k, their weights
    /// renormalised to sum to one when asked (`norm_topk_prob`).
    SoftmaxThenTopK { renormalise: bool },
    /// mixtral: the top k of the logits, a softmax over those k.
    TopKThenSoftmax,
}

/// mlx_lm sorts the (row, expert) choices by expert from this many on.
const SORT_FROM: usize = 64;

impl Experts {
    /// The block's output for `x` `(B, L, hidden)`.
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let (chosen, weights) = self.route(x)?;
        let y = self.switch_glu(x, &chosen)?;
        // (B, L, k, hidden) · (B, L, k, 1), summed over the k experts.
        let weighted = y.multiply(expand_dims_axes(&weights, &[-1])?)?;
        Ok(sum_axis(&weighted, -2, false)?.as_dtype(y.dtype())?)
    }

    /// Each position's `top_k` experts `(B, L, k)` and their weights, in
    /// mlx_lm's order (the order the k outputs are summed in).
    pub(crate) fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let logits = self.router.forward(x)?;
        let k = self.top_k;
        Ok(match self.routing {
            Routing::SoftmaxThenTopK { renormalise } => {
                let probs = softmax_axis(&logits, -1, true)?;
                let chosen = argpartition_axis(&probs, -k, -1)?;
                let last = chosen.dim(-1);
                let chosen = chosen.index((.., .., last - k..));
                let mut weights = take_along_axis(&probs, &chosen, -1)?;
                if renormalise {
                    weights = weights.divide(sum_axis(&weights, -1, true)?)?;
                }
                (chosen, weights)
            }
            Routing::TopKThenSoftmax => {
                let chosen = argpartition_axis(&logits.negative()?, k - 1, -1)?;
                let chosen = chosen.index((.., .., ..k));
                let scores = take_along_axis(&logits, &chosen, -1)?;
                (chosen, softmax_axis(&scores, -1, true)?)
            }
        })
    }

    /// Each chosen expert's gated MLP on its row: `(B, L, k, hidden)`.
    fn switch_glu(&self, x: &Array, chosen: &Array) -> Result<Array> {
        let (b, l, k) = (chosen.dim(0), chosen.dim(1), chosen.dim(2));
        let hidden = x.dim(-1);
        let rows = expand_dims_axes(x, &[-2, -3])?; // (B, L, 1, 1, hidden)
        let sorted = chosen.size() >= SORT_FROM;
        let (rows, order) = if sorted {
            let order = argsort_axis(&chosen.flatten(None, None)?, 0)?;
            // Row r's choices are entries r·k … r·k + k − 1 of the
            // flattened choices.
            let source = order.floor_divide(Array::from_int(k))?;
            let rows = rows.reshape(&[b * l, 1, hidden])?.take_axis(&source, 0)?;
            (rows, Some(order))
        } else {
            (rows, None)
        };
        // The choices in the products' order.
        let arranged = |ids: &Array| -> Result<Array> {
            Ok(match &order {
                Some(order) => ids.flatten(None, None)?.take_axis(order, 0)?,
                None => ids.clone(),
            })
        };
        let global = arranged(chosen)?;
        // A stack that takes its experts per forward multiplies the
        // distinct chosen ones, each taken once; the choices renumbered
        // among them keep their order, so sorting sorts both alike.
        let taken = match self.stacks.iter().any(ExpertStack::takes_chosen) {
            true => {
                let (distinct, local) = renumbered(chosen)?;
                Some((distinct, arranged(&local)?))
            }
            false => None,
        };
        let product = |stack: &ExpertStack, a: &Array| -> Result<Array> {
            match (stack, &taken) {
                (ExpertStack::Chosen(source), Some((distinct, local))) => {
                    source.take(distinct)?.product(a, local, sorted)
                }
                (ExpertStack::Chosen(source), None) => {
                    let (distinct, local) = renumbered(chosen)?;
                    source
                        .take(&distinct)?
                        .product(a, &arranged(&local)?, sorted)
                }
                (ExpertStack::Whole(matrices), _) => matrices.product(a, &global, sorted),
            }
        };
        let [gate, up, down] = &self.stacks;
        let up = product(up, &rows)?;
        let gate = product(gate, &rows)?;
        let down = product(down, &silu_mul(&gate, &up)?)?;
        let out = match &order {
            // (B·L·k, 1, hidden) back to the choices' order and shape.
            Some(order) => down
                .take_axis(&argsort_axis(order, 0)?, 0)?
                .reshape(&[b, l, k, 1, hidden])?,
            None => down,
        };
        Ok(out.squeeze_axes(&[-2])?)
    }
}

/// The distinct experts of `chosen` (ascending), and `chosen` renumbered
/// as places among them. Reads the routing: it is computed here.
fn renumbered(chosen: &Array) -> Result<(Vec<usize>, Array)> {
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
    Ok((distinct, Array::from_slice(&local, chosen.shape())))
}
