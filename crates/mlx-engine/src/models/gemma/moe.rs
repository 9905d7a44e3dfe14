//! Gemma 4's mixture-of-experts block (the 26B-A4B model), as mlx_lm
//! 0.32.2's `gemma4_text.py` computes it: beside each layer's dense MLP,
//! a router over the layer's input and routed experts with the MLP's
//! GeGLU, each branch normed, their sum the feed-forward output.

use mlx_rs::{fast, Array};

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, Why};
use crate::models::gemma::config::{GemmaMoe, Version};
use crate::models::gemma::ops::{gelu_mul, norm, scalar};
use crate::nn::experts::{Experts, Routing, TAKEN_AT_ONCE};
use crate::weights::{KeyPath, Weights};

pub(super) struct MoeBlock {
    experts: Experts,
    /// The router's norm weight, `scale · hidden^-½` (mlx_lm multiplies
    /// at each call, a Python float rounded to the weight's dtype).
    router_norm: Array,
    /// The dense MLP's output norm.
    after_mlp: Array,
    /// The experts' input and output norms.
    before_experts: Array,
    after_experts: Array,
}

impl MoeBlock {
    /// Whether its forward copies the chosen experts out of the files.
    pub(super) fn copies_experts(&self) -> bool {
        self.experts.copies_from_files()
    }

    /// Layer `layer`'s block; its experts held as the memory mode says
    /// (in the files but for resident weights).
    pub(super) fn load(
        w: &Weights<'_>,
        layer: &KeyPath,
        hidden: usize,
        moe: &GemmaMoe,
        version: Version,
    ) -> Result<MoeBlock> {
        let norm = |name: &str| norm(w, version, &layer.join(name).join("weight"), hidden);
        let router = layer.join("router");
        let scale = w.vector(&router.join("scale"), hidden)?;
        let router_norm = scale.multiply(scalar((hidden as f64).powf(-0.5), scale.dtype())?)?;
        let per_expert_scale = w.vector(&router.join("per_expert_scale"), moe.experts)?;
        // Lanes read the model's arrays from other threads: computed here.
        evaluate(Why::Load, [&router_norm])?;
        let experts = layer.join("experts");
        let fused = experts.join("gate_up_proj");
        if w.has(&fused) {
            return Err(Error::MissingWeight {
                dir: w.dir.to_path_buf(),
                key: format!(
                    "{} (the files hold Hugging Face's fused `{fused}`: convert the model \
                     with mlx_lm.convert, which splits it)",
                    experts.join("switch_glu").join("gate_proj").join("weight")
                ),
            });
        }
        let switch = experts.join("switch_glu");
        Ok(MoeBlock {
            experts: Experts {
                router: w.linear(&router.join("proj"), hidden, moe.experts)?,
                stacks: w.gated_expert_stacks(&switch, moe.experts, moe.intermediate, hidden)?,
                top_k: moe.top_k as i32,
                biases: None,
                routing: Routing::TopKThenScaledSoftmax {
                    per_expert_scale: Some(per_expert_scale),
                    precise: false,
                },
                gated: gelu_mul,
                taken_at_once: TAKEN_AT_ONCE,
                previous_step: Default::default(),
            },
            router_norm,
            after_mlp: norm("post_feedforward_layernorm_1")?,
            before_experts: norm("pre_feedforward_layernorm_2")?,
            after_experts: norm("post_feedforward_layernorm_2")?,
        })
    }

    /// The feed-forward output before the layer's last norm: the dense
    /// MLP's output `mlp` (of the layer's pre-feed-forward norm) normed,
    /// plus the experts' output for the layer's input `h`, normed.
    pub(super) fn beside_the_mlp(&self, h: &Array, mlp: &Array, eps: f32) -> Result<Array> {
        let dense = fast::rms_norm(mlp, Some(&self.after_mlp), eps)?;
        let routed = fast::rms_norm(h, Some(&self.router_norm), eps)?;
        let x = fast::rms_norm(h, Some(&self.before_experts), eps)?;
        let experts = fast::rms_norm(
            &self.experts.forward_routed_by(&routed, &x)?,
            Some(&self.after_experts),
            eps,
        )?;
        Ok(dense.add(&experts)?)
    }
}
