//! The engine bench's peers beside mlx_lm: llama.cpp through
//! llama-cpp-python (`llama_cpp_peer.py`); and what every side's runs are
//! measured by beside time and memory: the kernel's count of a process's
//! reads, and the profile of our runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{report, write_conversations};

/// A command for `program` that runs inside the memory cgroup whose
/// `cgroup.procs` is `cgroup` (`--memory-cap`, which `cargo xtask bench`
/// turns into a cgroup), or as it is: the child moves itself in before it
/// starts the program, so all it allocates and all the page cache it
/// brings in count against the cap.
pub fn command_in(cgroup: Option<&Path>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match cgroup {
        Some(procs) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(r#"echo $$ > "$0" && exec "$@""#)
                .arg(procs)
                .arg(program);
            c
        }
        None => Command::new(program),
    }
}

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
    cgroup: Option<&Path>,
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
    let out = command_in(cgroup, &python)
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
        println!(
            "{label} failed ({}): {}",
            out.status,
            err.lines().last().unwrap_or_default()
        );
    }
}

/// The GGUF of the 4-bit folder `q4`, exported once beside it
/// (`qwen3_moe_gguf.py`: the same 4-bit values as Q4_1 blocks, the
/// tokenizer copied from `vocab`); `None` (said) where it cannot be made.
pub fn exported_gguf(q4: &Path, vocab: &Path, python: Option<&str>) -> Option<PathBuf> {
    let out = q4.with_extension("gguf");
    if out.exists() {
        return Some(out);
    }
    let python = python?;
    // Written beside it and renamed, so a stopped export leaves nothing.
    let partial = q4.with_extension("gguf.partial");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/qwen3_moe_gguf.py");
    println!(
        "exporting {} to {} for llama.cpp",
        q4.display(),
        out.display()
    );
    let done = Command::new(python)
        .arg(script)
        .arg(q4)
        .arg(vocab)
        .arg(&partial)
        .output()
        .ok()?;
    if !done.status.success() || std::fs::rename(&partial, &out).is_err() {
        let err = String::from_utf8_lossy(&done.stderr);
        println!(
            "(llama.cpp not run: exporting the GGUF failed: {})",
            err.lines().last().unwrap_or_default()
        );
        let _ = std::fs::remove_file(&partial);
        return None;
    }
    Some(out)
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

/// A process's reads as the kernel counts them (`/proc/self/io`, Linux):
/// `rchar`, bytes returned by read calls (from the page cache or not), and
/// `read_bytes`, bytes it had fetched from storage (reads and mapped
/// pages). Printed by each side as one token, `io=RCHAR/READ_BYTES`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessIo {
    rchar: u64,
    read_bytes: u64,
}

impl ProcessIo {
    /// Now; zeros where there is no `/proc/self/io`.
    pub fn read() -> ProcessIo {
        let text = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
        let field = |name: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(name)?
                        .strip_prefix(": ")?
                        .trim()
                        .parse()
                        .ok()
                })
                .unwrap_or(0)
        };
        ProcessIo {
            rchar: field("rchar"),
            read_bytes: field("read_bytes"),
        }
    }

    /// What was read from `before` to this.
    pub fn since(self, before: ProcessIo) -> ProcessIo {
        ProcessIo {
            rchar: self.rchar.saturating_sub(before.rchar),
            read_bytes: self.read_bytes.saturating_sub(before.read_bytes),
        }
    }

    /// The `io=` token of a result line.
    pub fn parse(line: &str) -> Option<ProcessIo> {
        let (rchar, read_bytes) = line
            .split_whitespace()
            .find_map(|t| t.strip_prefix("io="))?
            .split_once('/')?;
        Some(ProcessIo {
            rchar: rchar.parse().ok()?,
            read_bytes: read_bytes.parse().ok()?,
        })
    }

    /// For a report of `generated` tokens.
    pub fn describe(&self, generated: f64) -> String {
        let per = |b: u64| b as f64 / 1e6 / generated.max(1.0);
        format!(
            ", read calls {:.0} MB ({:.1} per generated token), from storage {:.0} MB ({:.1} per generated token)",
            self.rchar as f64 / 1e6,
            per(self.rchar),
            self.read_bytes as f64 / 1e6,
            per(self.read_bytes)
        )
    }
}

impl std::fmt::Display for ProcessIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "io={}/{}", self.rchar, self.read_bytes)
    }
}
