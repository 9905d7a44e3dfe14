//! Labelling texts as cc-sentiment does on random Gemma checkpoints with a
//! word-level tokenizer (test-support's `gemma_words`, re-exported), and
//! mlx_lm's labels for them.

use std::path::Path;

use mlx_engine::{Message, SpecialTokens, Tokenizer};
use serde_json::json;

use super::logits::{run_parity_script, write_request};

// Each test binary uses some of these.
#[allow(unused_imports)]
pub use test_support::gemma_words::{
    label_ids, pieces, user_content, words_of, write_tokenizer, SPECIALS,
};

/// mlx_lm 0.32.2's one-token labels for `texts` on the model in `dir`:
/// each conversation is `system` then the user message cc-sentiment builds,
/// run by `batch_generate` on a copy of the prefix's own cache, with only
/// the `allowed` tokens left by the processor.
pub fn mlx_lm_labels(
    python: &str,
    dir: &Path,
    system: &str,
    texts: &[&str],
    allowed: &[u32],
) -> Vec<String> {
    let tokenizer = Tokenizer::load(dir).unwrap();
    let system = Message::new("system", system);
    let prefix = tokenizer
        .chat_tokens(std::slice::from_ref(&system), false, SpecialTokens::AsText)
        .unwrap();
    let suffixes: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| {
            let conversation = [system.clone(), Message::new("user", user_content(t))];
            let all = tokenizer
                .chat_tokens(&conversation, true, SpecialTokens::AsText)
                .unwrap();
            all.strip_prefix(prefix.as_slice()).unwrap().to_vec()
        })
        .collect();
    let body = json!({"prefix": prefix, "suffixes": suffixes, "max_tokens": 1, "eos": [1],
                      "allowed": allowed, "batch_only": true});
    let reference = run_parity_script(python, "mlx_lm_gemma.py", dir, &write_request(dir, &body));
    reference["batch_greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ids| {
            let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            tokenizer.decode(&ids).unwrap()
        })
        .collect()
}
