//! The llama family's mixtures of experts: qwen3_moe's, mixtral's and
//! gpt_oss's fields of `config.json`, how each names and routes its
//! experts, and a sparse layer's loading.

use crate::error::Result;
use crate::nn::experts::{Experts, Routing, TAKEN_AT_ONCE};
use crate::nn::fused::silu_mul;
use crate::weights::{KeyPath, Weights};

use super::gpt_oss;

/// The mixture of experts' fields of `config.json`: qwen3_moe's as mlx_lm's
/// `ModelArgs` names them; mixtral's are read into the same (see
/// [`MoeSettings::mixtral`]).
#[derive(Debug, Clone, serde::Deserialize)]
pub(super) struct MoeSettings {
    pub(super) num_experts: usize,
    pub(super) num_experts_per_tok: usize,
    #[serde(default = "one")]
    pub(super) decoder_sparse_step: usize,
    #[serde(default)]
    pub(super) mlp_only_layers: Vec<usize>,
    pub(super) moe_intermediate_size: usize,
    #[serde(default)]
    pub(super) norm_topk_prob: bool,
    /// Which of the two the checkpoint is.
    #[serde(skip)]
    pub(super) style: MoeStyle,
}

/// How a family lays out and routes its experts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum MoeStyle {
    /// Under `mlp`, a softmax over every expert, then the top k.
    #[default]
    Qwen3Moe,
    /// Under `block_sparse_moe`, the top k of the router's logits, then a
    /// softmax over those; every layer sparse.
    Mixtral,
    /// Under `mlp`: a biased `router`, the top k of its logits (chosen as
    /// qwen3_moe chooses), a precise softmax over those; `experts` with
    /// biases behind a clamped SwiGLU; every layer sparse.
    GptOss,
}

/// The experts' fields of mixtral's and gpt_oss's `config.json` (mlx_lm's
/// `ModelArgs`): every layer sparse.
#[derive(Debug, Clone, serde::Deserialize)]
pub(super) struct LocalExpertsFields {
    num_local_experts: usize,
    num_experts_per_tok: usize,
    intermediate_size: usize,
}

fn one() -> usize {
    1
}

impl MoeSettings {
    /// Every layer sparse, laid out and routed as `style` (mixtral,
    /// gpt_oss).
    pub(super) fn every_layer(fields: LocalExpertsFields, style: MoeStyle) -> MoeSettings {
        MoeSettings {
            num_experts: fields.num_local_experts,
            num_experts_per_tok: fields.num_experts_per_tok,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            moe_intermediate_size: fields.intermediate_size,
            norm_topk_prob: false,
            style,
        }
    }

    /// The feed-forward block's name within a layer.
    pub(super) fn block(&self) -> &'static str {
        match self.style {
            MoeStyle::Qwen3Moe | MoeStyle::GptOss => "mlp",
            MoeStyle::Mixtral => "block_sparse_moe",
        }
    }

    /// The router's and the stacked experts' names within the block.
    fn router_and_experts(&self) -> (&'static str, &'static str) {
        match self.style {
            MoeStyle::Qwen3Moe | MoeStyle::Mixtral => ("gate", "switch_mlp"),
            MoeStyle::GptOss => ("router", "experts"),
        }
    }

    fn routing(&self) -> Routing {
        match self.style {
            MoeStyle::Qwen3Moe => Routing::SoftmaxThenTopK {
                renormalise: self.norm_topk_prob,
            },
            MoeStyle::Mixtral => Routing::TopKThenSoftmax,
            MoeStyle::GptOss => Routing::TopKThenScaledSoftmax {
                per_expert_scale: None,
                precise: true,
            },
        }
    }

    /// Whether layer `i` routes to experts (mlx_lm's rule).
    pub(super) fn sparse(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.num_experts > 0
            && (i + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }

    pub(super) fn check(&self) -> std::result::Result<(), String> {
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(format!(
                "num_experts_per_tok {} must be between 1 and num_experts {}",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if self.moe_intermediate_size == 0 {
            return Err("moe_intermediate_size must be at least 1".into());
        }
        Ok(())
    }
}

/// A sparse layer's experts: the router and the stacked expert weights,
/// held as the memory mode and the quantized weights' handling say (see
/// `Weights::expert_stack`): a streamed layer's experts stay in the files.
pub(super) fn load_experts(
    w: &Weights<'_>,
    mlp: &KeyPath,
    hidden: usize,
    moe: &MoeSettings,
) -> Result<Experts> {
    let (e, inter) = (moe.num_experts, moe.moe_intermediate_size);
    let (router, experts) = moe.router_and_experts();
    let experts = mlp.join(experts);
    let gpt_oss = moe.style == MoeStyle::GptOss;
    // Before the stacks: a checkpoint in the original layout is named as
    // such, not as a missing stack.
    let biases = if gpt_oss {
        Some(gpt_oss::expert_biases(w, &experts, moe, hidden)?)
    } else {
        None
    };
    Ok(Experts {
        router: w.linear(&mlp.join(router), hidden, e)?,
        stacks: w.gated_expert_stacks(&experts, e, inter, hidden)?,
        biases,
        top_k: moe.num_experts_per_tok as i32,
        routing: moe.routing(),
        gated: if gpt_oss {
            gpt_oss::clamped_swiglu
        } else {
            |g, u| Ok(silu_mul(g, u)?)
        },
        taken_at_once: TAKEN_AT_ONCE,
        previous_step: Default::default(),
    })
}
