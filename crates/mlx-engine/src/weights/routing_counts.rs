//! What the routed experts of the process's models cost and chose: bytes
//! read from the files, and how the routers spread their choices (for
//! the benchmark's measurements; counted where the choices are read to the
//! host anyway).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Bytes of expert weights read from the files by this process so far.
static EXPERT_BYTES_READ: AtomicU64 = AtomicU64::new(0);

/// Bytes of routed expert weights read from the files so far (all models
/// of the process): what a forward over experts left in their files cost.
pub fn expert_bytes_read() -> u64 {
    EXPERT_BYTES_READ.load(Ordering::Relaxed)
}

/// How the routers of this process's models spread their choices so far,
/// counted where the choices are read to the host anyway: layers whose
/// experts are taken per forward (left in the files, or packed for the
/// host kernel). For measuring a model's routing (the benchmark); resident
/// experts multiplied by MLX are not counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingCounts {
    /// How often each expert id was chosen, over every layer and forward.
    pub choices: Vec<u64>,
    /// Each layer's forward of one position per row (a decode step): the
    /// first [`DECODE_STEPS_KEPT`] of the process, so that a server running
    /// for days does not grow by one entry per layer per step.
    pub decode_steps: Vec<DecodeStep>,
}

/// One layer's decode step, as [`RoutingCounts`] keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeStep {
    pub rows: u32,
    /// Distinct experts the rows chose between them.
    pub distinct: u32,
    /// How many of them the same layer chose at the decode step before;
    /// `None` after a prefill.
    pub reused: Option<u32>,
}

/// How many decode steps [`RoutingCounts`] keeps (12 MB of them).
pub const DECODE_STEPS_KEPT: usize = 1 << 20;

static ROUTING: Mutex<RoutingCounts> = Mutex::new(RoutingCounts {
    choices: Vec::new(),
    decode_steps: Vec::new(),
});

/// What the routers chose so far (see [`RoutingCounts`]).
pub fn routing_counts() -> RoutingCounts {
    ROUTING.lock().map(|r| r.clone()).unwrap_or_default()
}

/// Counts one layer's forward: `ids` chosen for `rows` rows of `positions`
/// positions each, `distinct` experts among them, `reused` of them chosen
/// by the layer's previous decode step.
pub(crate) fn count_routing(
    ids: &[u32],
    distinct: usize,
    rows: usize,
    positions: usize,
    reused: Option<usize>,
) {
    let Ok(mut counts) = ROUTING.lock() else {
        return;
    };
    for &id in ids {
        let id = id as usize;
        if counts.choices.len() <= id {
            counts.choices.resize(id + 1, 0);
        }
        counts.choices[id] += 1;
    }
    if positions == 1 && counts.decode_steps.len() < DECODE_STEPS_KEPT {
        counts.decode_steps.push(DecodeStep {
            rows: rows as u32,
            distinct: distinct as u32,
            reused: reused.map(|r| r as u32),
        });
    }
}

/// Counts `bytes` of expert weights read from the files.
pub(crate) fn count_expert_bytes(bytes: usize) {
    EXPERT_BYTES_READ.fetch_add(bytes as u64, Ordering::Relaxed);
}
