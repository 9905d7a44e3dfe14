//! The network's building blocks every decoder shares: attention over the
//! key/value cache (a shared prefix and the rows' own positions), the cache
//! and its masks, rotary positions and their scaling, the gated feed-forward block, compiled
//! element-wise arithmetic, and working a batch's rows a group at a time.

pub(crate) mod attention;
pub(crate) mod cache;
pub(crate) mod experts;
pub(crate) mod fused;
pub(crate) mod mlp;
pub(crate) mod rope;
pub(crate) mod rope_scaling;
pub(crate) mod row_groups;
