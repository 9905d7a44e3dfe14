//! Reading a `tokenizer.json` with less memory than
//! `tokenizers::Tokenizer::from_file`, to the same tokenizer.
//!
//! `from_file` reads the file's model through untagged helper types: the
//! whole model (for Gemma, 262,144 tokens and over half a million merges)
//! is buffered as serde content, copied, and turned into a
//! `serde_json::Value` before the BPE is built from that. Loading Gemma's
//! tokenizer so peaked about 370 MB above the process, for a tokenizer that
//! then holds about 105 MB; on a small machine with the layers streamed
//! that transient was most of the engine's peak. Here a BPE model is read
//! straight into `tokenizers`' own [`BPE`] (whose reader takes the fields
//! as they come), the other parts by `tokenizers`' own types, and the
//! added tokens are added last, as `from_file` adds them. Other models
//! (and files that do not name their model's type) go through
//! `tokenizers` unchanged.

use std::path::Path;

use serde::Deserialize;
use tokenizers::models::bpe::BPE;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PaddingParams,
    PostProcessorWrapper, PreTokenizerWrapper, TokenizerBuilder, TruncationParams,
};

/// The model's `type`, the rest of the file skipped.
#[derive(Deserialize)]
struct ModelType {
    model: Kind,
}

#[derive(Deserialize)]
struct Kind {
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// A `tokenizer.json` whose model is a BPE.
#[derive(Deserialize)]
struct BpeFile {
    version: Option<String>,
    truncation: Option<TruncationParams>,
    padding: Option<PaddingParams>,
    #[serde(default)]
    added_tokens: Vec<AddedTokenWithId>,
    normalizer: Option<NormalizerWrapper>,
    pre_tokenizer: Option<PreTokenizerWrapper>,
    model: BPE,
    decoder: Option<DecoderWrapper>,
    post_processor: Option<PostProcessorWrapper>,
}

/// An entry of `added_tokens`. Its id is where adding it will put it (the
/// model's id for a token the model has, the next free one otherwise);
/// `from_file` only warns when the two differ, and so the id is not read.
#[derive(Deserialize)]
struct AddedTokenWithId {
    #[serde(flatten)]
    token: AddedToken,
}

/// The tokenizer of the `tokenizer.json` at `path`, equal to what
/// `tokenizers::Tokenizer::from_file` returns.
pub(crate) fn read(path: &Path) -> tokenizers::Result<tokenizers::Tokenizer> {
    let json = std::fs::read_to_string(path)?;
    from_json(&json)
}

fn from_json(json: &str) -> tokenizers::Result<tokenizers::Tokenizer> {
    let ModelType { model } = serde_json::from_str(json)?;
    if model.kind.as_deref() != Some("BPE") {
        return Ok(serde_json::from_str(json)?);
    }
    let file: BpeFile = serde_json::from_str(json)?;
    if let Some(v) = file.version.as_deref().filter(|&v| v != "1.0") {
        return Err(format!("Unknown tokenizer version '{v}'").into());
    }
    let built = TokenizerBuilder::<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(file.model.into())
    .with_normalizer(file.normalizer)
    .with_pre_tokenizer(file.pre_tokenizer)
    .with_post_processor(file.post_processor)
    .with_decoder(file.decoder)
    .with_truncation(file.truncation)
    .with_padding(file.padding)
    .build()?;
    let mut tokenizer = tokenizers::Tokenizer::from(built);
    let added: Vec<AddedToken> = file.added_tokens.into_iter().map(|t| t.token).collect();
    tokenizer.add_tokens(&added);
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;

    /// A byte-level BPE with the parts a chat model's file has: added
    /// tokens (special and not, stripping), a normalizer, a post-processor
    /// and a decoder. `merges` is the merges' JSON, in either of the two
    /// forms files use.
    fn bpe_json(merges: &str) -> String {
        format!(
            r#"{{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {{"id": 0, "content": "<bos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}},
    {{"id": 9, "content": "<turn>", "single_word": false, "lstrip": true, "rstrip": false, "normalized": false, "special": true}},
    {{"id": 10, "content": "hello world", "single_word": true, "lstrip": false, "rstrip": false, "normalized": true, "special": false}}
  ],
  "normalizer": {{"type": "NFC"}},
  "pre_tokenizer": {{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}},
  "post_processor": {{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}},
  "decoder": {{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}},
  "model": {{
    "type": "BPE",
    "dropout": null,
    "unk_token": null,
    "continuing_subword_prefix": null,
    "end_of_word_suffix": null,
    "fuse_unk": false,
    "byte_fallback": false,
    "ignore_merges": false,
    "vocab": {{"<bos>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "he": 5, "ll": 6, "hell": 7, "Ġ": 8}},
    "merges": {merges}
  }}
}}"#
        )
    }

    /// Equal tokenizers: the same file written back, and the same ids for
    /// text with and without the added tokens.
    fn assert_same(json: &str) {
        let ours = from_json(json).unwrap();
        let theirs = tokenizers::Tokenizer::from_str(json).unwrap();
        assert_eq!(
            ours.to_string(false).unwrap(),
            theirs.to_string(false).unwrap()
        );
        for text in ["hello", "<bos>hello <turn>hell", "oh hello world", "héllo"] {
            let a = ours.encode(text, false).unwrap();
            let b = theirs.encode(text, false).unwrap();
            assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
            assert_eq!(a.get_offsets(), b.get_offsets(), "{text:?}");
        }
    }

    #[test]
    fn a_bpe_file_reads_to_the_tokenizer_from_file_reads() {
        assert_same(&bpe_json(r#"[["h", "e"], ["l", "l"], ["he", "ll"]]"#));
        assert_same(&bpe_json(r#"["h e", "l l", "he ll"]"#));
        // The read really is ours: the added tokens and merges took effect.
        let ours = from_json(&bpe_json(r#"["h e", "l l", "he ll"]"#)).unwrap();
        assert_eq!(ours.token_to_id("<turn>"), Some(9));
        assert_eq!(ours.token_to_id("hello world"), Some(10));
        let ids = ours.encode("<bos>hello", false).unwrap();
        assert_eq!(ids.get_ids(), &[0, 7, 4]);
    }

    #[test]
    fn other_models_and_bad_files_go_as_from_file_takes_them() {
        let word_level = r#"{"version": "1.0", "added_tokens": [],
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"},
            "pre_tokenizer": {"type": "Whitespace"}}"#;
        assert_same(word_level);
        assert!(from_json(r#"{"model": {"type": "BPE", "vocab": {}}}"#).is_err());
        let v2 = bpe_json("[]").replace(r#""version": "1.0""#, r#""version": "2.0""#);
        let err = from_json(&v2).unwrap_err().to_string();
        assert!(err.contains("Unknown tokenizer version '2.0'"), "{err}");
        assert!(tokenizers::Tokenizer::from_str(&v2).is_err());
        assert!(from_json("{").is_err());
    }
}
