//! A mixture-of-experts feed-forward block, as mlx_lm 0.32.2's
//! `Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`, Gemma 4's `Router`
//! and `Experts`, and `SwitchGLU` compute it: the router's choice of each position's top-k experts and
//! their weights (see [`Routing`]), each chosen expert's gated MLP through MLX's
//! `gather_mm` (`gather_qmm` for experts multiplied packed; rows sorted by expert once there are 64 or more choices,
//! as mlx_lm sorts them), and the experts' outputs summed by weight.

use mlx_rs::ops::indexing::{take_along_axis, IndexOp};
use mlx_rs::ops::{argpartition_axis, argsort_axis, expand_dims_axes, softmax_axis, sum_axis};
use mlx_rs::Array;
use std::sync::Mutex;

use crate::error::Result;
use crate::evaluation::{evaluate, host_slice, Why};
use crate::weights::routed::{chosen_ids, renumbered_ids, Choices, ExpertStack};
use crate::weights::routing_counts::count_routing;
use crate::weights::Linear;

/// The routed experts of one layer: stacked `(experts, out, in)` weights.
pub(crate) struct Experts {
    /// `(hidden → experts)`.
    pub router: Linear,
    /// The gate, up and down projections.
    pub stacks: [ExpertStack; 3],
    /// Each expert's biases of those projections, `(experts, out)` each
    /// (gpt_oss), added to its products as mlx_lm's `SwitchLinear` adds
    /// them; in memory in every mode (a vector per expert).
    pub biases: Option<[Array; 3]>,
    pub top_k: i32,
    pub routing: Routing,
    /// The experts' gated activation, `act(gate) · up`: SiLU (qwen3_moe,
    /// mixtral), tanh-approximated GELU (Gemma 4) or gpt_oss's clamped
    /// SwiGLU.
    pub gated: GatedActivation,
    /// Bytes of experts a forward takes (unpacks, or reads dense) at once,
    /// about: past it, the chosen experts are taken and multiplied a group
    /// at a time, each group's products computed before the next is taken.
    pub taken_at_once: usize,
    /// The distinct experts of this layer's last decode step (none after a
    /// prefill), for counting how many the next step chooses again.
    pub previous_step: Mutex<Vec<usize>>,
}

/// [`Experts::taken_at_once`] as loaded: 16 of Qwen3-30B-A3B's experts
/// unpacked to f32 (18.9 MB each), where all 128 would be 2.4 GB.
pub(crate) const TAKEN_AT_ONCE: usize = 320_000_000;

/// `act(gate) · up` of a gated MLP.
pub(crate) type GatedActivation = fn(&Array, &Array) -> Result<Array>;

/// How the router's logits choose the experts and weigh them.
#[derive(Debug, Clone)]
pub(crate) enum Routing {
    /// qwen3_moe: a softmax over every expert, its top k, their weights
    /// renormalised to sum to one when asked (`norm_topk_prob`).
    SoftmaxThenTopK { renormalise: bool },
    /// mixtral: the top k of the logits, a softmax over those k.
    TopKThenSoftmax,
    /// Gemma 4 and gpt_oss: the top k of the logits (chosen as qwen3_moe
    /// chooses, on the logits), a softmax over those k (in f32 for lower
    /// precisions when `precise`: gpt_oss), each weight multiplied by its
    /// expert's learned scale `(experts,)` where there is one (Gemma 4).
    TopKThenScaledSoftmax {
        per_expert_scale: Option<Array>,
        precise: bool,
    },
}

/// mlx_lm sorts the (row, expert) choices by expert from this many on.
const SORT_FROM: usize = 64;

impl Experts {
    /// Whether a forward copies its chosen experts out of the files (see
    /// `RoutedExperts::copies_from_files`).
    pub(crate) fn copies_from_files(&self) -> bool {
        self.stacks.iter().any(|s| s.copies_from_files())
    }

    /// The block's output for `x` `(B, L, hidden)`.
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        self.forward_routed_by(x, x)
    }

    /// The block's output for `x`, the experts chosen from `routed` (Gemma
    /// 4 routes the layer's input normed otherwise than the experts').
    pub(crate) fn forward_routed_by(&self, routed: &Array, x: &Array) -> Result<Array> {
        let (chosen, weights) = self.route(routed)?;
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
        Ok(match &self.routing {
            Routing::SoftmaxThenTopK { renormalise } => {
                let probs = softmax_axis(&logits, -1, true)?;
                let chosen = argpartition_axis(&probs, -k, -1)?;
                let last = chosen.dim(-1);
                let chosen = chosen.index((.., .., last - k..));
                let mut weights = take_along_axis(&probs, &chosen, -1)?;
                if *renormalise {
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
            Routing::TopKThenScaledSoftmax {
                per_expert_scale,
                precise,
            } => {
                let chosen = argpartition_axis(&logits, -k, -1)?;
                let last = chosen.dim(-1);
                let chosen = chosen.index((.., .., last - k..));
                let scores = take_along_axis(&logits, &chosen, -1)?;
                let mut weights = softmax_axis(&scores, -1, *precise)?;
                if let Some(scale) = per_expert_scale {
                    weights = weights.multiply(scale.take_axis(&chosen, 0)?)?;
                }
                (chosen, weights)
            }
        })
    }

    /// Each chosen expert's gated MLP on its row: `(B, L, k, hidden)`.
    fn switch_glu(&self, x: &Array, chosen: &Array) -> Result<Array> {
        let per_expert: usize = self
            .stacks
            .iter()
            .map(|stack| stack.taken_bytes_per_expert())
            .sum();
        // The routing read once, where a stack takes its experts per
        // forward (`per_expert` above 0); else no groups, nothing taken.
        let read = match self.taken_at_once.checked_div(per_expert) {
            Some(at_once) => {
                let at_once = at_once.max(1);
                // How many of the experts the layer's previous decode step
                // chose this one chooses again (counted; asking the files
                // for them ahead was measured to cost more than it saved,
                // docs/benchmarks.md).
                let previous = self
                    .previous_step
                    .lock()
                    .map(|p| p.clone())
                    .unwrap_or_default();
                let (ids, distinct) = chosen_ids(chosen)?;
                let (rows, positions) = (chosen.dim(0) as usize, chosen.dim(1) as usize);
                let decode = positions == 1;
                let reused = (decode && !previous.is_empty())
                    .then(|| distinct.iter().filter(|e| previous.contains(e)).count());
                count_routing(&ids, distinct.len(), rows, positions, reused);
                if let Ok(mut step) = self.previous_step.lock() {
                    *step = if decode { distinct.clone() } else { Vec::new() };
                }
                if distinct.len() > at_once {
                    return self.switch_glu_in_groups(x, chosen, &ids, &distinct, at_once);
                }
                self.ask(&distinct)?;
                Some((ids, distinct))
            }
            None => None,
        };
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
        let taken = match read {
            Some((ids, distinct)) => {
                let local = renumbered_ids(&ids, &distinct, chosen.shape());
                Some((distinct, arranged(&local)?))
            }
            None => None,
        };
        let choices = Choices {
            global: &global,
            taken: taken
                .as_ref()
                .map(|(distinct, local)| (&distinct[..], local)),
        };
        let down = self.gated_mlp(&rows, &choices, sorted)?;
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

impl Experts {
    /// [`switch_glu`](Self::switch_glu) for choices `ids` (`chosen`
    /// flattened) among `distinct` experts, `at_once` of them taken at a
    /// time, each group's products computed before the next group is
    /// taken. Each choice's products are those the whole forward computes,
    /// bit for bit: sorted, a group's rows are its experts' run of the
    /// sorted choices; unsorted (few choices), every group multiplies every
    /// row in the whole forward's layout, and keeps its own choices' rows.
    fn switch_glu_in_groups(
        &self,
        x: &Array,
        chosen: &Array,
        ids: &[u32],
        distinct: &[usize],
        at_once: usize,
    ) -> Result<Array> {
        if ids.len() < SORT_FROM {
            return self.unsorted_in_groups(x, chosen, ids, distinct, at_once);
        }
        let (b, l, k) = (chosen.dim(0), chosen.dim(1), chosen.dim(2));
        let hidden = x.dim(-1);
        // The choices sorted by expert, as places in `ids`.
        let order = argsort_axis(&chosen.flatten(None, None)?, 0)?;
        let order: Vec<u32> = host_slice::<u32>(Why::Host, "routed experts", &order)?.to_vec();
        let rows = x.reshape(&[b * l, 1, hidden])?;
        let mut outputs = Vec::new();
        let mut start = 0;
        for group in distinct.chunks(at_once) {
            let last = group[group.len() - 1] as u32;
            let run = order[start..]
                .iter()
                .take_while(|&&c| ids[c as usize] <= last)
                .count();
            let choices = &order[start..start + run];
            start += run;
            let n = choices.len() as i32;
            let of_row: Vec<u32> = choices.iter().map(|&c| c / k as u32).collect();
            let group_rows = rows.take_axis(Array::from_slice(&of_row, &[n]), 0)?;
            let global: Vec<u32> = choices.iter().map(|&c| ids[c as usize]).collect();
            let down = self.group_products(group, &group_rows, &global, &[n], true)?;
            // Computed now, so that this group's experts are dropped
            // before the next group's are taken.
            evaluate(Why::Piece, [&down])?;
            outputs.push(down);
        }
        // (choices, 1, hidden) sorted by expert, back to the choices' own
        // order and shape.
        let all = mlx_rs::ops::concatenate(&outputs, 0)?;
        let back = argsort_axis(Array::from_slice(&order, &[order.len() as i32]), 0)?;
        let out = all.take_axis(&back, 0)?.reshape(&[b, l, k, 1, hidden])?;
        Ok(out.squeeze_axes(&[-2])?)
    }

    /// The unsorted case of [`switch_glu_in_groups`](Self::switch_glu_in_groups):
    /// MLX multiplies rows laid out `(B, L, 1, 1, hidden)` against the
    /// `(B, L, k)` choices otherwise than a list of rows (rounding), so each
    /// group runs the whole layout, its other choices pointed at one of its
    /// own experts, and keeps its own choices' results. At most 63 choices:
    /// a few groups of a few rows.
    fn unsorted_in_groups(
        &self,
        x: &Array,
        chosen: &Array,
        ids: &[u32],
        distinct: &[usize],
        at_once: usize,
    ) -> Result<Array> {
        let rows = expand_dims_axes(x, &[-2, -3])?; // (B, L, 1, 1, hidden)
        let mut out: Option<Array> = None;
        for group in distinct.chunks(at_once) {
            let (first, last) = (group[0] as u32, group[group.len() - 1] as u32);
            let mine: Vec<bool> = ids.iter().map(|&e| (first..=last).contains(&e)).collect();
            let global: Vec<u32> = ids
                .iter()
                .zip(&mine)
                .map(|(&e, &m)| if m { e } else { first })
                .collect();
            let down = self.group_products(group, &rows, &global, chosen.shape(), false)?;
            let mut shape = chosen.shape().to_vec();
            shape.extend([1, 1]);
            let mine = Array::from_slice(&mine, &shape);
            let kept = match out {
                Some(sum) => mlx_rs::ops::select(&mine, &down, &sum)?,
                None => down,
            };
            evaluate(Why::Piece, [&kept])?;
            out = Some(kept);
        }
        let out = out.unwrap_or_else(|| Array::from_f32(0.0));
        Ok(out.squeeze_axes(&[-2])?)
    }

    /// Asks every stack's storage for `experts` at once (the routing now
    /// known), so that the reads of the gate's experts overlap the fetch
    /// of the up and down projections' (see [`RoutedExperts::ask`]).
    fn ask(&self, experts: &[usize]) -> Result<()> {
        for stack in &self.stacks {
            stack.ask(experts)?;
        }
        Ok(())
    }

    /// The gated MLP of `rows` for the choices `global` (experts' own
    /// numbers, laid out as `shape`), all among `group`: the stacks that
    /// take experts take `group`'s.
    fn group_products(
        &self,
        group: &[usize],
        rows: &Array,
        global: &[u32],
        shape: &[i32],
        sorted: bool,
    ) -> Result<Array> {
        let local: Vec<u32> = global
            .iter()
            .map(|&e| group.partition_point(|&d| d < e as usize) as u32)
            .collect();
        self.ask(group)?;
        let (global, local) = (
            Array::from_slice(global, shape),
            Array::from_slice(&local, shape),
        );
        let choices = Choices {
            global: &global,
            taken: Some((group, &local)),
        };
        self.gated_mlp(rows, &choices, sorted)
    }

    /// The chosen experts' gated MLP of `rows`: each projection's product,
    /// its experts' biases added where they have them.
    fn gated_mlp(&self, rows: &Array, choices: &Choices<'_>, sorted: bool) -> Result<Array> {
        let product = |which: usize, a: &Array| -> Result<Array> {
            let y = self.stacks[which].product(a, choices, sorted)?;
            Ok(match &self.biases {
                // `(…, 1, out)` products; the choices' biases `(…, out)`.
                Some(biases) => {
                    let bias = biases[which].take_axis(choices.global, 0)?;
                    y.add(expand_dims_axes(&bias, &[-2])?)?
                }
                None => y,
            })
        };
        let (gate, up, down) = (0, 1, 2);
        let up = product(up, rows)?;
        let gate = product(gate, rows)?;
        product(down, &(self.gated)(&gate, &up)?)
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::quantize;
    use mlx_rs::random;
    use mlx_support::Quantization;

    use super::*;
    use crate::weights::kernels::HostKernels;

    const EXPERTS: i32 = 16;
    const HIDDEN: i32 = 64;
    const INTER: i32 = 32;
    const Q: Quantization = Quantization::affine(32, 4);

    fn normal(shape: &[i32], seed: u64) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap()
    }

    /// How a test's experts are multiplied.
    #[derive(Debug, Clone, Copy)]
    enum Taken {
        /// Unpacked to f32, by `gather_mm`.
        Unpacked,
        /// Packed, by `gather_qmm`.
        Packed,
        /// Packed, by the project's kernel.
        OnHost,
    }

    /// Random 4-bit experts in memory, taken per forward, `taken_at_once`
    /// bytes of them at a time, multiplied as `taken` says.
    fn experts(taken: Taken, taken_at_once: usize) -> Experts {
        let packed = |shape: &[i32], seed| {
            let (w, s, b) = quantize(normal(shape, seed), Q.group_size, Q.bits).unwrap();
            let (unpack, on_host) = match taken {
                Taken::Unpacked => (true, None),
                Taken::Packed => (false, None),
                Taken::OnHost => (true, Some(HostKernels::for_tests(2))),
            };
            crate::weights::routed::ChosenSource::chosen_in_memory(
                w,
                Some((s, b, Q)),
                unpack,
                on_host,
            )
        };
        let (router, s, b) = quantize(normal(&[EXPERTS, HIDDEN], 1), 32, 4).unwrap();
        Experts {
            router: crate::weights::linear::packed_on_use(router, s, b, Q),
            stacks: [
                packed(&[EXPERTS, INTER, HIDDEN], 2),
                packed(&[EXPERTS, INTER, HIDDEN], 3),
                packed(&[EXPERTS, HIDDEN, INTER], 4),
            ],
            biases: None,
            top_k: 4,
            routing: Routing::SoftmaxThenTopK { renormalise: true },
            gated: |g, u| Ok(crate::nn::fused::silu_mul(g, u)?),
            taken_at_once,
            previous_step: Mutex::default(),
        }
    }

    /// Taken three experts at a time, a forward's output equals the one
    /// that takes them all at once, bit for bit: with few choices (in the
    /// rows' order) and with many (sorted by expert), unpacked or packed,
    /// by MLX or by the project's kernel.
    #[test]
    fn experts_taken_in_groups_give_the_same_bits() {
        let per_expert = 3 * (INTER * HIDDEN) as usize * 4;
        let on_host = cpu_kernels::supported().then_some(Taken::OnHost);
        for taken in [Taken::Unpacked, Taken::Packed].into_iter().chain(on_host) {
            let (whole, grouped) = (experts(taken, usize::MAX), experts(taken, 3 * per_expert));
            // 3 × 5 × 4 = 60 choices (not sorted), 4 × 6 × 4 = 96 (sorted).
            for (shape, seed) in [([3, 5, HIDDEN], 10), ([4, 6, HIDDEN], 11)] {
                let x = normal(&shape, seed);
                let (chosen, _) = whole.route(&x).unwrap();
                let (_, distinct) = chosen_ids(&chosen).unwrap();
                assert!(distinct.len() > 6, "the groups are at least three");
                let a = whole.forward(&x).unwrap();
                let b = grouped.forward(&x).unwrap();
                assert_eq!(a.shape(), [shape[0], shape[1], HIDDEN]);
                assert_eq!(
                    a.as_slice::<f32>(),
                    b.as_slice::<f32>(),
                    "{taken:?}, {shape:?}"
                );
            }
        }
    }
}
