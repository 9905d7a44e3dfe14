//! Chat templates render as Hugging Face renders them (transformers'
//! `apply_chat_template`, which mlx_lm calls): block tags on lines of their
//! own leave no lines behind (`trim_blocks`, `lstrip_blocks`),
//! `strftime_now` dates the prompt (Llama 3's templates test for it, and
//! gpt-oss's call it), loop controls, namespaces and macros work. The
//! templates are written here to exercise each. Skips, saying so, without
//! a Python that has transformers (`MLX_LOWMEM_PYTHON`).

mod common;

use std::path::{Path, PathBuf};

use mlx_engine::{Message, Tokenizer};

/// Block tags on lines of their own, indented.
const LINES: &str = "\
{% for message in messages %}
    {% if message['role'] == 'system' %}
<s> {{ message['content'] }}
    {% else %}
<{{ message['role'] }}> {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<a>
{% endif %}
";

/// A date, a namespace, a macro and a loop that stops early.
const DATED: &str = "\
{%- macro line(m) -%}{{ m.role }}: {{ m.content | trim }}{%- endmacro -%}
{%- if strftime_now is defined %}{% set today = strftime_now('%d %b %Y') %}{% else %}{% set today = 'no date' %}{% endif -%}
Today is {{ today }}.
{% set ns = namespace(users=0) %}
{% for m in messages %}
  {% if m.role == 'assistant' and loop.last %}{% break %}{% endif %}
  {% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
{{ line(m) }}
{% endfor %}
users: {{ ns.users }}
{% if add_generation_prompt %}assistant:{% endif %}";

fn folder(root: &Path, name: &str, template: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    common::write_tokenizer(&dir, true);
    let config = serde_json::json!({
        "chat_template": template,
        "eos_token": "<eos>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn chat_templates_render_as_transformers_renders_them() {
    let test = "chat_templates_render_as_transformers_renders_them";
    let Some(python) = test_support::python::python_with(test, "transformers") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let dirs = [
        folder(work.path(), "lines", LINES),
        folder(work.path(), "dated", DATED),
    ];
    let conversations = [
        vec![
            Message::new("system", "Be terse."),
            Message::new("user", "w1 w2"),
            Message::new("assistant", "w3"),
            Message::new("user", " w4 "),
        ],
        vec![Message::new("user", "w5"), Message::new("assistant", "w6")],
    ];
    let mut cases = Vec::new();
    let mut ours = Vec::new();
    for dir in &dirs {
        let tokenizer = Tokenizer::load(dir).unwrap();
        for messages in &conversations {
            for add_generation_prompt in [true, false] {
                let json: Vec<_> = (messages.iter())
                    .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                    .collect();
                cases.push(serde_json::json!({
                    "dir": dir, "messages": json, "add_generation_prompt": add_generation_prompt,
                }));
                let rendered = tokenizer.apply_chat_template(messages, add_generation_prompt);
                ours.push(rendered.unwrap());
            }
        }
    }
    let cases_path = work.path().join("cases.json");
    std::fs::write(&cases_path, serde_json::to_string(&cases).unwrap()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/parity/chat_templates.py");
    let theirs: Vec<String> =
        test_support::python::run_json(&python, &script, &[cases_path.as_os_str()]);
    assert_eq!(theirs.len(), ours.len());
    for (i, (ours, theirs)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(ours, theirs, "case {i}: {}", cases[i]);
    }
    // The date is today's, not the template's fallback.
    assert!(!ours[4].contains("no date"), "{}", ours[4]);
}

#[test]
fn a_format_strftime_cannot_read_is_an_error_not_a_panic() {
    let work = tempfile::tempdir().unwrap();
    let dir = folder(work.path(), "bad", "{{ strftime_now('%Q%') }}");
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let error = tokenizer
        .apply_chat_template(&[Message::new("user", "w1")], true)
        .unwrap_err();
    assert!(error.to_string().contains("strftime"), "{error}");
}
