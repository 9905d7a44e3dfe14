//! The engine bench's peers beside mlx_lm: llama.cpp through
//! llama-cpp-python (`llama_cpp_peer.py`), and the profile of our runs.

use std::path::Path;
use std::process::Command;

use super::{report, write_conversations};

/// llama.cpp on `gguf`, which the 4-bit folder `dir` was imported from,
/// on the same `n` conversations, where `MLX_LOWMEM_PYTHON` has
/// llama-cpp-python (`cargo xtask bench engine --llama-cpp` installs
/// it).
pub fn llama_cpp(
    gguf: &Path,
    dir: &Path,
    temp: &Path,
    (n, system_words): (usize, usize),
    max_tokens: &str,
) {
    let Ok(python) = std::env::var("MLX_LOWMEM_PYTHON") else {
        return;
    };
    let has = Command::new(&python)
        .args(["-c", "import llama_cpp"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        println!("(llama.cpp not run: no llama_cpp in {python}; `cargo xtask bench engine --llama-cpp` installs it)");
        return;
    }
    let convs = temp.join(format!("conversations-{n}.json"));
    write_conversations(&convs, n, system_words);
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/llama_cpp_peer.py");
    let out = Command::new(&python)
        .arg(script)
        .arg(dir)
        .arg(gguf)
        .arg(&convs)
        .arg(max_tokens)
        .arg(threads.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let label = format!(
        "q4 max_tokens {max_tokens} llama.cpp {} ({}, {threads} threads, one conversation at a time)",
        gguf.file_name().unwrap_or_default().to_string_lossy(),
        text.lines().next().unwrap_or_default()
    );
    if out.status.success() {
        report(&label, text.lines().last().unwrap_or_default(), None);
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        println!("{label} failed: {}", err.lines().last().unwrap_or_default());
    }
}

/// `--profile`: the engine's spans in a child's run (`chunk`, and within
/// it `prefill` and `decode`; `prefix_prefill`), each span's busy time
/// summed over the run, from the lines the child's subscriber printed as
/// each span closed. With lanes, chunks overlap: the sums can pass the
/// wall time.
pub fn print_profile(stderr: &str) {
    let mut spans: Vec<(String, f64, usize)> = Vec::new();
    for line in stderr.lines() {
        let Some((context, times)) = line.split_once(" close time.busy=") else {
            continue;
        };
        let busy = times.split_whitespace().next().unwrap_or_default();
        let seconds = [("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)]
            .iter()
            .find_map(|(unit, scale)| {
                busy.strip_suffix(unit)?
                    .parse::<f64>()
                    .ok()
                    .map(|v| v * scale)
            });
        // `… chunk{rows=8}:decode{rows=8 max_tokens=32}: mlx_engine::…:`
        let path = context
            .rsplit_once(": mlx_engine")
            .map_or(context, |(p, _)| p);
        let name = path.rsplit(':').next().unwrap_or_default();
        // The span's name, after the time and level of a top-level one.
        let name = name.split('{').next().unwrap_or_default();
        let name = name.split_whitespace().last().unwrap_or_default();
        let (Some(seconds), false) = (seconds, name.is_empty()) else {
            continue;
        };
        match spans.iter_mut().find(|(n, _, _)| n == name) {
            Some((_, total, count)) => {
                *total += seconds;
                *count += 1;
            }
            None => spans.push((name.to_owned(), seconds, 1)),
        }
    }
    for (name, total, count) in spans {
        println!("  profile: {name:<15} {total:8.3} s busy in {count} spans");
    }
}
