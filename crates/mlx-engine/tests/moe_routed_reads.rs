//! Experts left in the files are read only when routed: a forward of one
//! token reads exactly the experts it chose (top 2 of 8 in each of the two
//! sparse layers), each once, and a batch reads each chosen expert once for
//! all the rows that chose it; so too for packed experts (weights, scales
//! and biases), multiplied packed or unpacked. The routing counters see
//! every choice of those forwards and none of the resident model's. Its own
//! test binary, one test: the counters are the process's.

mod common;

use common::tiny_moe::{write_qwen3_moe, write_qwen3_moe_quantized, EXPERTS};
use mlx_engine::{expert_bytes_read, routing_counts, KvCache, MemoryMode, Model, QuantizedWeights};
use mlx_rs::Array;

/// One expert's gate, up and down matrices: 3 × 32 × 64 f32.
const EXPERT_BYTES: u64 = 3 * 32 * 64 * 4;

#[test]
fn only_the_routed_experts_are_read_once_per_forward() {
    let dir = tempfile::tempdir().unwrap();
    write_qwen3_moe(dir.path());
    let mapped = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .memory(MemoryMode::MappedTables)
        .load()
        .unwrap();
    let resident = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    assert_eq!(expert_bytes_read(), 0, "nothing is read at load");

    let one = Array::from_slice(&[5i32], &[1, 1]);
    let logits = mapped.forward(&one, &mut KvCache::new()).unwrap();
    logits.eval().unwrap();
    // 2 sparse layers × top 2.
    assert_eq!(expert_bytes_read(), 2 * 2 * EXPERT_BYTES);
    let counts = routing_counts();
    assert_eq!(counts.choices.iter().sum::<u64>(), 2 * 2);
    // One position per row: a decode step in each layer, 1 row, 2 experts.
    let step = mlx_engine::DecodeStep {
        rows: 1,
        distinct: 2,
        reused: None,
    };
    assert_eq!(counts.decode_steps, [step, step]);
    let same = resident.forward(&one, &mut KvCache::new()).unwrap();
    assert_eq!(
        logits.as_slice::<f32>(),
        same.as_slice::<f32>(),
        "bit for bit"
    );

    // 24 tokens choose 48 (token, expert) pairs per layer among 8 experts:
    // each distinct expert is read once per layer, never more.
    let tokens: Vec<i32> = (0..24).map(|i| (i * 5 + 1) % 40).collect();
    let batch = Array::from_slice(&tokens, &[2, 12]);
    let before = expert_bytes_read();
    let logits = mapped.forward(&batch, &mut KvCache::new()).unwrap();
    logits.eval().unwrap();
    let read = expert_bytes_read() - before;
    assert!(read <= 2 * EXPERTS as u64 * EXPERT_BYTES, "{read}");
    assert_eq!(read % EXPERT_BYTES, 0);
    // 2 layers × 24 positions × top 2 more choices; 12 positions per row
    // are no decode step.
    let counts = routing_counts();
    assert_eq!(counts.choices.iter().sum::<u64>(), 4 + 2 * 24 * 2);
    assert!(counts.choices.len() <= EXPERTS as usize);
    assert_eq!(counts.decode_steps.len(), 2);
    let same = resident.forward(&batch, &mut KvCache::new()).unwrap();
    assert_eq!(
        logits.as_slice::<f32>(),
        same.as_slice::<f32>(),
        "bit for bit"
    );
    assert_eq!(
        routing_counts().choices.iter().sum::<u64>(),
        4 + 2 * 24 * 2,
        "the resident model's experts are multiplied by MLX, uncounted"
    );

    quantized_experts_are_read_as_routed();

    // Experts alone in the files (the tables resident): read as routed too.
    let experts_only = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .memory(MemoryMode::ExpertsInFiles)
        .load()
        .unwrap();
    let before = expert_bytes_read();
    let logits = experts_only.forward(&one, &mut KvCache::new()).unwrap();
    logits.eval().unwrap();
    assert_eq!(expert_bytes_read() - before, 2 * 2 * EXPERT_BYTES);
    let same = resident.forward(&one, &mut KvCache::new()).unwrap();
    assert_eq!(
        logits.as_slice::<f32>(),
        same.as_slice::<f32>(),
        "bit for bit"
    );
}

/// Packed bytes of one expert's three projections, weights and f32 scales
/// and biases (`write_qwen3_moe_quantized`): in layer 0 the gate
/// projection (32 × 64) is 8-bit in groups of 64, 2048 + 256 bytes; every
/// other projection is 4-bit in groups of 32, 1024 + 512 bytes.
const PACKED_EXPERT_BYTES: [u64; 2] = [2304 + 2 * 1536, 3 * 1536];

fn quantized_experts_are_read_as_routed() {
    let dir = tempfile::tempdir().unwrap();
    write_qwen3_moe_quantized(dir.path());
    let one = Array::from_slice(&[5i32], &[1, 1]);
    let tokens: Vec<i32> = (0..24).map(|i| (i * 5 + 1) % 40).collect();
    let batch = Array::from_slice(&tokens, &[2, 12]);
    for handling in [QuantizedWeights::Keep, QuantizedWeights::DequantizeOnUse] {
        let load = |memory| {
            Model::loader(dir.path())
                .quantized(handling)
                .memory(memory)
                .load()
                .unwrap()
        };
        let (mapped, resident) = (load(MemoryMode::MappedTables), load(MemoryMode::Resident));
        let before = expert_bytes_read();
        let logits = mapped.forward(&one, &mut KvCache::new()).unwrap();
        logits.eval().unwrap();
        // Top 2 in each of the two sparse layers.
        let read = expert_bytes_read() - before;
        assert_eq!(
            read,
            2 * PACKED_EXPERT_BYTES[0] + 2 * PACKED_EXPERT_BYTES[1],
            "{handling:?}"
        );
        let same = resident.forward(&one, &mut KvCache::new()).unwrap();
        assert_eq!(
            logits.as_slice::<f32>(),
            same.as_slice::<f32>(),
            "{handling:?}: bit for bit"
        );
        let before = expert_bytes_read();
        let logits = mapped.forward(&batch, &mut KvCache::new()).unwrap();
        logits.eval().unwrap();
        let read = expert_bytes_read() - before;
        let most = EXPERTS as u64 * (PACKED_EXPERT_BYTES[0] + PACKED_EXPERT_BYTES[1]);
        assert!(read <= most, "{handling:?}: {read} > {most}");
        let same = resident.forward(&batch, &mut KvCache::new()).unwrap();
        assert_eq!(
            logits.as_slice::<f32>(),
            same.as_slice::<f32>(),
            "{handling:?}: bit for bit"
        );
    }
}
