//! The engine on MLX's distributed engine: ranks started as child processes
//! on 127.0.0.1 only, by the launcher, each job bounded in time and ended
//! whatever happens. The outputs of every placement are compared with the
//! one-process engine's, bit for bit (texts, and a digest of each
//! conversation's last-position logits).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mlx_support::distributed::{Launch, LaunchError, RankExit};
use serde_json::Value;

fn smollm2(test: &str, variant: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("MLX_LOWMEM_SMOLLM2").map(|d| PathBuf::from(d).join(variant));
    match dir {
        Some(dir) if dir.join("config.json").is_file() => Some(dir),
        _ => {
            eprintln!("SKIP {test}: MLX_LOWMEM_SMOLLM2 is not set (cargo xtask test sets it)");
            None
        }
    }
}

fn generate_bin() -> &'static str {
    env!("CARGO_BIN_EXE_mlx-generate")
}

const SYSTEM: &str = "You are a helpful assistant who answers briefly.";

/// Conversations of different lengths, so that a batch holds padded rows.
fn conversations(dir: &Path) -> PathBuf {
    let texts = [
        "What is the capital of France?",
        "Write a haiku about the sea, please, with care and with a little rhyme.",
        "2+2=",
        "Name three colours.",
        "Explain in one sentence why the sky is blue, as you would to a child of six.",
        "Hello!",
    ];
    let list: Vec<Value> = texts
        .iter()
        .map(|t| serde_json::json!([{"role": "user", "content": t}]))
        .collect();
    let path = dir.join("conversations.json");
    std::fs::write(&path, serde_json::to_string(&list).unwrap()).unwrap();
    path
}

fn args(model: &Path, conversations: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--model",
        model.to_str().unwrap(),
        "--conversations",
        conversations.to_str().unwrap(),
        "--system",
        SYSTEM,
        "--max-tokens",
        "8",
        "--batch-size",
        "4",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    a.extend(extra.iter().map(|s| (*s).to_owned()));
    a
}

fn result_of(rank: &RankExit) -> Value {
    let line = rank
        .output
        .iter()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("rank {} printed no result: {:#?}", rank.rank, rank.output));
    serde_json::from_str(line).unwrap()
}

/// `n` ranks of mlx-generate. Every job, the one-process reference too,
/// runs OpenBLAS on one thread: a product split over another number of
/// threads may sum in another order (a long prompt's logits differed in
/// their last bits between two threads and one).
///
/// The ranks keep the digests of the model's files (which they compare at
/// load) in a folder of the job's, not the user's cache.
fn job(n: usize, args: &[String]) -> Result<Vec<RankExit>, LaunchError> {
    let digests = tempfile::tempdir().unwrap();
    Launch::new(&["127.0.0.1"], n, generate_bin())
        .args(args)
        .env("OPENBLAS_NUM_THREADS", "1")
        .env("MLX_LOWMEM_CACHE", digests.path().to_str().unwrap())
        .timeout(Duration::from_secs(240))
        .echo(false)
        .run()
}

/// What every rank says, for a failed job's assertion messages.
fn said(ranks: &[RankExit]) -> String {
    ranks
        .iter()
        .map(|r| format!("rank {}: {}", r.rank, r.output.join(" | ")))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every rank's texts and last-position logits are `one`'s, bit for bit.
fn every_rank_answers_as(one: &Value, ranks: &[RankExit], what: &str) {
    for rank in ranks {
        let r = result_of(rank);
        let what = format!("{what}, rank {}", rank.rank);
        assert_eq!(r["texts"], one["texts"], "{what}");
        assert_eq!(r["logits_sha256"], one["logits_sha256"], "{what}");
    }
}

fn failed_ranks(err: LaunchError) -> Vec<RankExit> {
    match err {
        LaunchError::RankFailed { ranks, .. } | LaunchError::Timeout { ranks, .. } => ranks,
        other => panic!("{other}"),
    }
}

#[test]
fn a_pipeline_of_two_or_three_ranks_answers_as_one_process_bit_for_bit() {
    let test = "a_pipeline_of_two_or_three_ranks_answers_as_one_process_bit_for_bit";
    let dir = tempfile::tempdir().unwrap();
    let conversations = conversations(dir.path());
    for variant in ["f32", "q4"] {
        let Some(model) = smollm2(test, variant) else {
            return;
        };
        let one = result_of(&job(1, &args(&model, &conversations, &["--logits"])).unwrap()[0]);
        assert_eq!(one["texts"].as_array().unwrap().len(), 6);
        let placements: &[(usize, &str)] = match variant {
            "f32" => &[(2, "resident"), (3, "resident"), (2, "streamed")],
            _ => &[(2, "mapped")],
        };
        for &(n, memory) in placements {
            let extra = [
                "--logits",
                "--placement",
                "pipeline",
                "--memory",
                memory,
                "--all-ranks",
            ];
            let ranks = job(n, &args(&model, &conversations, &extra)).unwrap();
            every_rank_answers_as(&one, &ranks, &format!("{variant}, {n} ranks, {memory}"));
        }
    }
}

#[test]
fn explicit_layer_ranges_and_data_parallel_ranks_answer_as_one_process() {
    let test = "explicit_layer_ranges_and_data_parallel_ranks_answer_as_one_process";
    let Some(model) = smollm2(test, "q4") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let conversations = conversations(dir.path());
    let one = result_of(&job(1, &args(&model, &conversations, &[])).unwrap()[0]);
    // SmolLM2-135M has 30 layers: an uneven split.
    let extra = [
        "--placement",
        "pipeline",
        "--layers",
        "0..5,5..30",
        "--all-ranks",
    ];
    for rank in job(2, &args(&model, &conversations, &extra)).unwrap() {
        assert_eq!(
            result_of(&rank)["texts"],
            one["texts"],
            "rank {}",
            rank.rank
        );
    }
    let extra = ["--placement", "data", "--all-ranks"];
    let ranks = job(2, &args(&model, &conversations, &extra)).unwrap();
    for rank in &ranks {
        let r = result_of(rank);
        assert_eq!(r["texts"], one["texts"], "rank {}", rank.rank);
        assert_eq!(r["generated_tokens"], one["generated_tokens"]);
    }
}

#[test]
fn ranks_on_different_model_folders_or_requests_fail_with_a_typed_error() {
    let test = "ranks_on_different_model_folders_or_requests_fail_with_a_typed_error";
    let (Some(f32), Some(q4)) = (smollm2(test, "f32"), smollm2(test, "q4")) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let conversations = conversations(dir.path());
    let other = dir.path().join("other.json");
    std::fs::write(
        &other,
        r#"[[{"role": "user", "content": "Something else"}]]"#,
    )
    .unwrap();
    for (placement, rank1, says) in [
        (
            "pipeline",
            args(&q4, &conversations, &["--placement", "pipeline"]),
            "loaded another model",
        ),
        (
            "data",
            args(&q4, &conversations, &["--placement", "data"]),
            "loaded another model",
        ),
        (
            "data",
            args(&f32, &other, &["--placement", "data"]),
            "was asked for another generation",
        ),
    ] {
        let start = Instant::now();
        let err = Launch::new(&["127.0.0.1"], 2, generate_bin())
            .args(args(&f32, &conversations, &["--placement", placement]))
            .rank_command(1, generate_bin(), rank1)
            .timeout(Duration::from_secs(120))
            .echo(false)
            .run()
            .unwrap_err();
        let ranks = failed_ranks(err);
        let text = said(&ranks);
        assert!(text.contains(says), "{placement}: {text}");
        assert!(
            start.elapsed() < Duration::from_secs(100),
            "{placement}: {text}"
        );
    }
}

/// A peer that exits after joining (its sockets close) and one that stays
/// without taking part (its sockets stay open): the engine's rank returns
/// a typed error either way, the second after its peer timeout.
#[test]
fn a_peer_that_dies_or_stalls_is_an_error_not_a_hang() {
    let test = "a_peer_that_dies_or_stalls_is_an_error_not_a_hang";
    let Some(model) = smollm2(test, "f32") else {
        return;
    };
    let Some(python) = test_support::python::python_with(test, "mlx.core") else {
        return;
    };
    let fault = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/parity/ring_fault.py");
    let dir = tempfile::tempdir().unwrap();
    let conversations = conversations(dir.path());
    for (mode, timeout, says) in [
        // A long peer timeout where the peer exits: the closed socket, not
        // the timeout, must end the wait, however slow a loaded machine
        // makes the load.
        ("exit", "60", "connection to a peer was lost"),
        ("stall", "5", "no answer within 5s"),
    ] {
        let start = Instant::now();
        let extra = ["--placement", "pipeline", "--peer-timeout", timeout];
        let err = Launch::new(&["127.0.0.1"], 2, generate_bin())
            .args(args(&model, &conversations, &extra))
            .rank_command(1, &python, [fault, mode])
            .timeout(Duration::from_secs(120))
            .echo(false)
            .run()
            .unwrap_err();
        let ranks = failed_ranks(err);
        let text = said(&ranks);
        assert_eq!(
            ranks[0].status.and_then(|s| s.code()),
            Some(1),
            "{mode}: {text}"
        );
        assert!(
            ranks[0]
                .output
                .iter()
                .any(|l| l.starts_with("ERROR") && l.contains(says)),
            "{mode}: {text}"
        );
        assert!(start.elapsed() < Duration::from_secs(100), "{mode}: {text}");
    }
}

/// A random Gemma 4 with every feature the split must respect: sliding
/// windows (5 positions, under a 270-word prefix), two KV-shared layers
/// that read layers 2 and 3's keys in the same forward (so no cut after
/// layer 2), and per-layer inputs, which every stage computes from the
/// scaled embedding the first stage sends along.
#[test]
fn a_gemma4_pipeline_answers_as_one_process_bit_for_bit() {
    use common::tiny_gemma::{
        conversations as gemma_conversations, system, write_gemma4_in, Layout,
    };
    let dir = tempfile::tempdir().unwrap();
    let conversations = conversation_file(dir.path(), &gemma_conversations());
    for (name, quantized, dtype) in [
        ("f32", false, mlx_rs::Dtype::Float32),
        ("bf16-q", true, mlx_rs::Dtype::Bfloat16),
    ] {
        let model = dir.path().join(name);
        write_gemma4_in(&model, Layout::Text, quantized, dtype);
        let base = |extra: &[&str]| {
            let mut a = vec![
                "--model".to_owned(),
                model.to_str().unwrap().to_owned(),
                "--conversations".into(),
                conversations.to_str().unwrap().into(),
                "--system".into(),
                system().content,
                "--max-tokens".into(),
                "6".into(),
                "--batch-size".into(),
                "3".into(),
                "--logits".into(),
                "--quantized".into(),
                "keep".into(),
            ];
            a.extend(extra.iter().map(|s| (*s).to_owned()));
            a
        };
        let one = result_of(&job(1, &base(&[])).unwrap()[0]);
        for n in [2, 3] {
            let ranks = job(n, &base(&["--placement", "pipeline", "--all-ranks"])).unwrap();
            every_rank_answers_as(&one, &ranks, &format!("{name}, {n} ranks"));
        }
        // A cut between the KV-shared layers and their sources is refused,
        // on every rank, with the reason.
        let err = job(
            2,
            &base(&["--placement", "pipeline", "--layers", "0..4,4..6"]),
        )
        .unwrap_err();
        let text = said(&failed_ranks(err));
        assert!(text.contains("cannot be cut before layer 4"), "{text}");
    }
}

/// A random 6-layer qwen2 (biases on the queries, keys and values, a tied
/// head), with the shard index mlx_lm's `sharded_load` reads.
fn write_qwen2(dir: &Path) {
    let keys = test_support::tiny_llama::TinyLlama {
        layers: 6,
        vocab: common::VOCAB,
        seed: 100,
        config: serde_json::json!({
            "rms_norm_eps": 1e-6, "eos_token_id": 44, "max_position_embeddings": 512
        }),
        ..test_support::tiny_llama::TinyLlama::new("qwen2")
    }
    .write(dir);
    let map: serde_json::Map<String, Value> = keys
        .into_iter()
        .map(|k| (k, Value::from("model.safetensors")))
        .collect();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    common::write_tokenizer(dir, false);
    // transformers would pick Qwen2's own tokenizer class by the model type,
    // not the word-level tokenizer.json.
    let path = dir.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["tokenizer_class"] = "PreTrainedTokenizerFast".into();
    std::fs::write(&path, config.to_string()).unwrap();
}

/// mlx_lm's own pipeline (`sharded_load` on two ranks, started by our
/// launcher) and ours answer alike: the same greedy texts.
#[test]
fn our_pipeline_answers_as_mlx_lms_sharded_pipeline_on_qwen2() {
    let test = "our_pipeline_answers_as_mlx_lms_sharded_pipeline_on_qwen2";
    let Some(python) = test_support::python::mlx_lm_python(test) else {
        return;
    };
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/parity/mlx_lm_pipeline.py"
    );
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen2");
    write_qwen2(&model);
    let list: Vec<Value> = [
        "w1 w2 w3",
        "w7",
        "w10 w11 w12 w13 w14 w15 w16 w17",
        "w30 w2",
    ]
    .iter()
    .map(|t| serde_json::json!([{"role": "user", "content": t}]))
    .collect();
    let conversations = dir.path().join("conversations.json");
    std::fs::write(&conversations, serde_json::to_string(&list).unwrap()).unwrap();
    let theirs = Launch::new(&["127.0.0.1"], 2, &python)
        .args([
            script,
            model.to_str().unwrap(),
            conversations.to_str().unwrap(),
            "8",
        ])
        .timeout(Duration::from_secs(240))
        .echo(false)
        .run()
        .unwrap_or_else(|e| panic!("mlx_lm's pipeline: {e:?}"));
    let theirs = result_of(&theirs[0]);
    assert_eq!(theirs["version"], "0.32.2");
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--conversations",
        conversations.to_str().unwrap(),
        "--max-tokens",
        "8",
        "--placement",
        "pipeline",
    ];
    let ours = result_of(&job(2, &args.map(String::from)).unwrap()[0]);
    let texts = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().trim().to_owned())
            .collect()
    };
    assert_eq!(texts(&ours["texts"]), texts(&theirs["texts"]));
    assert!(texts(&ours["texts"]).iter().any(|t| !t.is_empty()));
}

/// The user messages of `conversations` (each a system message, then a
/// user's) as mlx-generate reads them; the system message goes in
/// `--system`.
fn conversation_file(dir: &Path, conversations: &[Vec<mlx_engine::Message>]) -> PathBuf {
    let list: Vec<Value> = conversations
        .iter()
        .map(|c| serde_json::json!([{"role": "user", "content": c[1].content}]))
        .collect();
    let path = dir.join("conversations.json");
    std::fs::write(&path, serde_json::to_string(&list).unwrap()).unwrap();
    path
}

/// `model` as a pipeline of 2 and of 3 ranks, under `Keep` and under the
/// CPU default: every rank's texts and last-position logits are the one
/// process's, bit for bit.
fn pipelines_answer_as_one_process(what: &str, model: &Path, conversations: &Path, system: &str) {
    for arithmetic in [&["--quantized", "keep"][..], &[]] {
        let base = |extra: &[&str]| {
            [
                "--model",
                model.to_str().unwrap(),
                "--conversations",
                conversations.to_str().unwrap(),
                "--system",
                system,
                "--max-tokens",
                "6",
                "--batch-size",
                "3",
                "--logits",
            ]
            .iter()
            .chain(arithmetic)
            .chain(extra)
            .map(|s| (*s).to_owned())
            .collect::<Vec<String>>()
        };
        let one = result_of(&job(1, &base(&[])).unwrap()[0]);
        for n in [2, 3] {
            let ranks = job(n, &base(&["--placement", "pipeline", "--all-ranks"]))
                .unwrap_or_else(|e| panic!("{what} {arithmetic:?}, {n} ranks: {e}"));
            every_rank_answers_as(&one, &ranks, &format!("{what} {arithmetic:?}, {n} ranks"));
        }
    }
}

/// Every family in the half-precision dtypes its published MLX checkpoints
/// have — bfloat16 or float16, dense or quantized with scales in that
/// dtype, as mlx_lm's `convert` writes them — pipelines on 2 and 3 ranks
/// as one process computes, under `Keep` and the CPU default: a stage
/// boundary carries the dtype the stage computed, whatever the embedding's.
/// Gemma 4 (the real application's family, 4-bit with bfloat16 scales) is
/// written here and needs no Python.
#[test]
fn half_precision_pipelines_of_every_family_answer_as_one_process_bit_for_bit() {
    use common::tiny_gemma::{self, write_gemma4_in, Layout};
    let test = "half_precision_pipelines_of_every_family_answer_as_one_process_bit_for_bit";
    let dir = tempfile::tempdir().unwrap();
    let gemma_conversations = conversation_file(dir.path(), &tiny_gemma::conversations());
    let gemma_system = tiny_gemma::system().content;
    let gemma4 = dir.path().join("gemma4");
    write_gemma4_in(&gemma4, Layout::Text, true, mlx_rs::Dtype::Bfloat16);
    pipelines_answer_as_one_process(
        "gemma4 4-bit, bfloat16 scales",
        &gemma4,
        &gemma_conversations,
        &gemma_system,
    );
    let Some(python) = test_support::python::mlx_lm_python(test) else {
        return;
    };
    let words = dir.path().join("words");
    std::fs::create_dir_all(&words).unwrap();
    let word_conversations = conversation_file(&words, &common::conversations());
    let word_system = common::system().content;
    for (family, dtype, quantize) in [
        ("llama", "bfloat16", Some((4, 32))),
        ("llama", "float16", None),
        ("qwen2", "bfloat16", Some((8, 64))),
        ("qwen3", "float16", Some((4, 32))),
        ("qwen3_moe", "bfloat16", Some((4, 32))),
        ("mixtral", "float16", None),
        ("gemma3", "bfloat16", Some((4, 32))),
    ] {
        let what = format!("{family} {dtype} {quantize:?}");
        let model = dir.path().join(what.replace(' ', "-"));
        common::converted::write_converted(&python, family, &model, dtype, quantize);
        let (conversations, system) = match family {
            "gemma3" => (&gemma_conversations, &gemma_system),
            _ => (&word_conversations, &word_system),
        };
        pipelines_answer_as_one_process(&what, &model, conversations, system);
    }
}

/// Gemma 4's MoE variant (the 26B-A4B's parts), 4-bit with bfloat16
/// scales and 8-bit routers: pipelines on 2 and 3 ranks answer as one
/// process, under `Keep` and the CPU default, its experts in the files of
/// every stage.
#[test]
fn gemma4_moe_pipelines_answer_as_one_process_bit_for_bit() {
    use common::tiny_gemma::{self, write_gemma4_moe_in};
    let dir = tempfile::tempdir().unwrap();
    let conversations = conversation_file(dir.path(), &tiny_gemma::conversations());
    let model = dir.path().join("gemma4-moe");
    write_gemma4_moe_in(&model, true, mlx_rs::Dtype::Bfloat16);
    pipelines_answer_as_one_process(
        "gemma4 MoE 4-bit, bfloat16 scales",
        &model,
        &conversations,
        &tiny_gemma::system().content,
    );
}

/// gpt_oss (sliding and full layers, sinks, YaRN positions, biased
/// experts), 4-bit with bfloat16 scales and 8-bit routers: pipelines on 2
/// and 3 ranks answer as one process, cut between layers of either kind.
#[test]
fn gpt_oss_pipelines_answer_as_one_process_bit_for_bit() {
    use common::tiny_gpt_oss::write_gpt_oss_in;
    let dir = tempfile::tempdir().unwrap();
    let conversations = conversation_file(dir.path(), &common::conversations());
    let model = dir.path().join("gpt-oss");
    std::fs::create_dir_all(&model).unwrap();
    write_gpt_oss_in(&model, true, mlx_rs::Dtype::Bfloat16);
    pipelines_answer_as_one_process(
        "gpt_oss 4-bit, bfloat16 scales",
        &model,
        &conversations,
        &common::system().content,
    );
}

/// A copy of the model folder `from` in `to`.
fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// One bit flipped in the middle of `key`'s bytes in `dir`'s weights: far
/// from the first and last bytes of any tensor.
fn flip_a_bit_inside(dir: &Path, key: &str) {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let offsets = &header[key]["data_offsets"];
    let (start, end) = (offsets[0].as_u64().unwrap(), offsets[1].as_u64().unwrap());
    let middle = 8 + header_len + ((start + end) / 2) as usize;
    bytes[middle] ^= 1;
    std::fs::write(&path, bytes).unwrap();
}

/// Rank 1's folder differs from rank 0's in one file that changes an
/// answer — the chat template, the tokenizer, one bit inside a tensor —
/// and every rank fails at load with the typed error naming that file, as
/// a pipeline and as data parallel, instead of stalling or answering
/// differently.
#[test]
fn ranks_whose_template_tokenizer_or_tensor_bytes_differ_fail_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    common::write_model(&base);
    let conversations = conversation_file(dir.path(), &common::conversations());
    type Change = (&'static str, fn(&Path));
    let changes: [Change; 3] = [
        ("tokenizer_config.json", |d| {
            let path = d.join("tokenizer_config.json");
            let text = std::fs::read_to_string(&path).unwrap();
            std::fs::write(&path, text.replace("<u> ", "<u> <u> ")).unwrap();
        }),
        ("tokenizer.json", |d| {
            let path = d.join("tokenizer.json");
            let text = std::fs::read_to_string(&path).unwrap();
            let swapped = text
                .replace("\"w38\"", "\"tmp\"")
                .replace("\"w39\"", "\"w38\"")
                .replace("\"tmp\"", "\"w39\"");
            std::fs::write(&path, swapped).unwrap();
        }),
        ("model.safetensors", |d| {
            flip_a_bit_inside(d, "model.layers.0.mlp.up_proj.weight")
        }),
    ];
    for (file, change) in changes {
        let other = dir.path().join(file);
        copy_folder(&base, &other);
        change(&other);
        for placement in ["pipeline", "data"] {
            let base_args = |model: &Path| args(model, &conversations, &["--placement", placement]);
            let start = Instant::now();
            let err = Launch::new(&["127.0.0.1"], 2, generate_bin())
                .args(base_args(&base))
                .rank_command(1, generate_bin(), base_args(&other))
                .timeout(Duration::from_secs(120))
                .echo(false)
                .run()
                .unwrap_err();
            let ranks = failed_ranks(err);
            let text = said(&ranks);
            for rank in &ranks {
                assert!(
                    rank.output.iter().any(|l| l.starts_with("ERROR")
                        && l.contains("loaded another model")
                        && l.contains(&format!("its {file} differs"))),
                    "{file}, {placement}, rank {}: {text}",
                    rank.rank
                );
            }
            assert_eq!(ranks.len(), 2, "{text}");
            assert!(start.elapsed() < Duration::from_secs(100), "{text}");
        }
    }
}
