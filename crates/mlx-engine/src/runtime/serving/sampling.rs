//! Picking a row's next token from its logits, on the host.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::runtime::serving::Sampling;

/// A row's sampler: its settings and its own random stream, so that a
/// seeded request draws the same tokens whatever else is in the batch.
#[derive(Debug)]
pub(crate) struct Sampler {
    sampling: Sampling,
    rng: StdRng,
}

/// What a pick gives: the token, and with logprobs asked, its
/// log-probability and the top `k` `(id, logprob)`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Picked {
    pub id: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

impl Sampler {
    pub(crate) fn new(sampling: Sampling) -> Sampler {
        let seed = sampling.seed.unwrap_or_else(|| rand::rng().random());
        Sampler {
            sampling,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The next token from `logits` (one row, the vocabulary's width).
    /// `None` when the logits hold NaN (NaN or infinite weights): no
    /// token is the most likely then.
    pub(crate) fn pick(&mut self, logits: &[f32], logprobs: Option<usize>) -> Option<Picked> {
        let mut logits = logits.to_vec();
        for &(id, bias) in &self.sampling.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if logits.iter().any(|l| l.is_nan()) {
            return None;
        }
        let t = self.sampling.temperature;
        let id = if t <= 0.0 {
            argmax(&logits)
        } else {
            self.draw(&logits, t)
        };
        let (logprob, top) = match logprobs {
            None => (None, Vec::new()),
            Some(k) => {
                let norm = log_sum_exp(&logits);
                let lp = |i: usize| (f64::from(logits[i]) - norm) as f32;
                let top = top_k(&logits, k)
                    .into_iter()
                    .map(|i| (i as u32, lp(i)))
                    .collect();
                (Some(lp(id)), top)
            }
        };
        Some(Picked {
            id: id as u32,
            logprob,
            top,
        })
    }

    /// A draw from `softmax(logits / t)`, restricted to the nucleus.
    fn draw(&mut self, logits: &[f32], t: f32) -> usize {
        let scaled: Vec<f64> = logits.iter().map(|&l| f64::from(l / t)).collect();
        let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scaled.iter().map(|&s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut order: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0.0).collect();
        let top_p = f64::from(self.sampling.top_p);
        if top_p < 1.0 {
            // Most likely first; ties by id, so the order is the same on
            // every run.
            order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
            let mut mass = 0.0;
            let mut keep = 0;
            for &i in &order {
                mass += weights[i] / total;
                keep += 1;
                if mass >= top_p {
                    break;
                }
            }
            order.truncate(keep.max(1));
        }
        let kept: f64 = order.iter().map(|&i| weights[i]).sum();
        let mut target = self.rng.random::<f64>() * kept;
        for &i in &order {
            target -= weights[i];
            if target < 0.0 {
                return i;
            }
        }
        // Rounding left the target at the end: the last candidate.
        order.last().copied().unwrap_or(0)
    }
}

/// The index of the largest value, the first on ties (as MLX's argmax).
pub(crate) fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

fn log_sum_exp(values: &[f32]) -> f64 {
    let max = values
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
        .into();
    if !f64::is_finite(max) {
        return max;
    }
    let sum: f64 = values.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    max + sum.ln()
}

/// The indices of the `k` largest values, largest first (ties by index).
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let cmp = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    order.select_nth_unstable_by(k - 1, cmp);
    order.truncate(k);
    order.sort_by(cmp);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_bias_moves_it() {
        let mut s = Sampler::new(Sampling::greedy());
        assert_eq!(s.pick(&[1.0, 3.0, 3.0, 2.0], None).unwrap().id, 1);
        let mut s = Sampler::new(Sampling::greedy().logit_bias(vec![(3, 5.0)]));
        assert_eq!(s.pick(&[1.0, 3.0, 3.0, 2.0], None).unwrap().id, 3);
        assert_eq!(s.pick(&[1.0, f32::NAN, 0.0, 0.0], None), None);
    }

    #[test]
    fn logprobs_are_a_normalised_log_softmax_with_the_top_in_order() {
        let mut s = Sampler::new(Sampling::greedy());
        let logits = [0.0f32, (2.0f32).ln(), 0.0, 0.0];
        let p = s.pick(&logits, Some(2)).unwrap();
        // Probabilities 1/5, 2/5, 1/5, 1/5.
        assert_eq!(p.id, 1);
        assert!((p.logprob.unwrap() - (0.4f32).ln()).abs() < 1e-6);
        assert_eq!(p.top.len(), 2);
        assert_eq!((p.top[0].0, p.top[1].0), (1, 0));
        assert!((p.top[1].1 - (0.2f32).ln()).abs() < 1e-6);
    }

    #[test]
    fn a_seed_repeats_its_draws_and_top_p_keeps_the_nucleus() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let draws = |seed| {
            let mut s = Sampler::new(Sampling::greedy().temperature(1.0).seed(seed));
            (0..40)
                .map(|_| s.pick(&logits, None).unwrap().id)
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
        // One token holds 0.9 of the mass: top_p 0.5 always takes it.
        let mut peaked = vec![0.0f32; 10];
        peaked[4] = 10.0;
        let mut s = Sampler::new(Sampling::greedy().temperature(1.0).top_p(0.5).seed(1));
        assert!((0..100).all(|_| s.pick(&peaked, None).unwrap().id == 4));
        // Without top_p, other tokens come up too.
        let mut s = Sampler::new(Sampling::greedy().temperature(5.0).seed(1));
        assert!((0..200).any(|_| s.pick(&peaked, None).unwrap().id != 4));
    }
}
