//! Routed experts read from the files, three ways, cold and warm: what a
//! mixture of experts with its experts left in the files does at every
//! decode step (mlx-engine's `FileStack::read`).
//!
//! Each step reads one layer's chosen experts: `--experts` of them (8 by
//! default, the top-k of Gemma 4 26B-A4B), spread evenly over the layer's
//! experts and shifted each step by a hash of the step, every stacked tensor of the layer
//! (`…experts…` tensors of three dimensions: weights, scales, biases) at
//! those rows. The layers are taken in turn, `--steps` steps in all.
//!
//! - `pread, fresh zeroed buffer`: a positioned read into a new zeroed
//!   buffer per expert tensor — the engine's way (MLX's buffer, zeroed when
//!   made, then read into);
//! - `pread, reused buffer`: the same reads into one buffer kept across
//!   reads;
//! - `copy from the mapping`: the bytes copied out of the file's memory map
//!   into one reused buffer (page faults bring them in);
//! - `pread, next step asked ahead`: as `pread, reused buffer`, each step
//!   first asking the files for the next step's experts
//!   (`SafetensorsSet::advise_will_read`), so that storage works on them
//!   while this step's are read;
//! - `pread, step asked first`: each step asks for all its own experts at
//!   once, then reads them in turn — what an engine can do once a layer's
//!   router has chosen (no guess: only bytes about to be read).
//!
//! Cold: the files dropped from the page cache first (Linux's
//! `posix_fadvise(DONTNEED)`, maps closed); warm: the same steps again at
//! once, every byte now in the page cache. Every file is advised for random
//! reads, as the engine advises its expert files.
//!
//! Usage: `cargo bench -p st-mmap --bench expert_reads -- --dir MODEL_DIR
//! [--steps N] [--experts K]` (`cargo xtask bench expert-reads` runs it on
//! the 26B-A4B-shaped bench model).

use std::path::{Path, PathBuf};
use std::time::Instant;

use st_mmap::SafetensorsSet;

/// One expert-stack tensor: its key and its experts' count.
struct Stack {
    key: String,
    experts: usize,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let Some(dir) = value("--dir").map(PathBuf::from) else {
        eprintln!(
            "expert_reads: give --dir MODEL_DIR (a folder of .safetensors with stacked experts)"
        );
        std::process::exit(2);
    };
    let steps: usize = value("--steps").map_or(30, |v| v.parse().expect("--steps N"));
    let per_step: usize = value("--experts").map_or(8, |v| v.parse().expect("--experts K"));

    let layers = expert_stacks(&dir);
    if layers.is_empty() {
        eprintln!("expert_reads: no stacked experts in {}", dir.display());
        std::process::exit(2);
    }
    let plan = read_plan(&layers, steps, per_step);
    let bytes: usize = plan_bytes(&dir, &plan);
    println!(
        "expert reads: {} layers with experts, {steps} steps of {per_step} experts, {:.1} MB per pass ({})",
        layers.len(),
        bytes as f64 / 1e6,
        dir.display()
    );
    println!(
        "| method | cold MB/s | cold ms/step | warm MB/s | warm ms/step |\n| --- | --- | --- | --- | --- |"
    );
    let methods = [
        Method::PreadFresh,
        Method::PreadReused,
        Method::MapCopy,
        Method::PreadAskedAhead,
        Method::PreadAskedFirst,
    ];
    for method in methods {
        let cold = {
            evict(&dir);
            run(&dir, &plan, method)
        };
        let warm = run(&dir, &plan, method);
        let rate = |s: f64| bytes as f64 / 1e6 / s;
        let per_step = |s: f64| s * 1e3 / steps as f64;
        println!(
            "| {} | {:.0} | {:.2} | {:.0} | {:.2} |",
            method.name(),
            rate(cold),
            per_step(cold),
            rate(warm),
            per_step(warm)
        );
    }
}

#[derive(Debug, Clone, Copy)]
enum Method {
    PreadFresh,
    PreadReused,
    MapCopy,
    PreadAskedAhead,
    PreadAskedFirst,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::PreadFresh => "pread, fresh zeroed buffer",
            Method::PreadReused => "pread, reused buffer",
            Method::MapCopy => "copy from the mapping",
            Method::PreadAskedAhead => "pread, next step asked ahead",
            Method::PreadAskedFirst => "pread, step asked first",
        }
    }
}

/// Each layer's stacked-expert tensors, layers in key order.
fn expert_stacks(dir: &Path) -> Vec<Vec<Stack>> {
    let set = SafetensorsSet::open_dir(dir).expect("the model's weights");
    let mut by_layer: std::collections::BTreeMap<usize, Vec<Stack>> = Default::default();
    for key in set.keys() {
        let Some(view) = set.tensor(key) else {
            continue;
        };
        if view.shape.len() != 3 || !key.contains("experts") {
            continue;
        }
        let layer = key
            .split('.')
            .find_map(|part| part.parse::<usize>().ok())
            .unwrap_or(0);
        by_layer.entry(layer).or_default().push(Stack {
            key: key.to_owned(),
            experts: view.shape[0],
        });
    }
    by_layer.into_values().collect()
}

/// Step `s` reads layer `s mod layers`: `per_step` experts spread evenly
/// over the layer's experts, shifted by a Fibonacci hash of `s` (so that
/// steps rarely read a set again: a cold pass stays cold).
fn read_plan(layers: &[Vec<Stack>], steps: usize, per_step: usize) -> Vec<Vec<(String, usize)>> {
    let mut plan = Vec::new();
    for s in 0..steps {
        let mut reads = Vec::new();
        let layer = &layers[s % layers.len()];
        for stack in layer {
            let n = stack.experts;
            let stride = (n / per_step.max(1)).max(1);
            let shift = ((s as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize;
            let mut chosen: Vec<usize> = (0..per_step.min(n))
                .map(|j| (shift + j * stride) % n)
                .collect();
            chosen.sort_unstable();
            chosen.dedup();
            reads.extend(chosen.into_iter().map(|e| (stack.key.clone(), e)));
        }
        plan.push(reads);
    }
    plan
}

fn plan_bytes(dir: &Path, plan: &[Vec<(String, usize)>]) -> usize {
    let set = SafetensorsSet::open_dir(dir).expect("the model's weights");
    plan.iter()
        .flatten()
        .map(|(key, _)| {
            let view = set.tensor(key).expect("a planned tensor");
            view.data.len() / view.shape[0]
        })
        .sum()
}

/// Every safetensors file of `dir` out of the page cache (no map of them
/// open: the kernel keeps mapped pages).
fn evict(dir: &Path) {
    for entry in std::fs::read_dir(dir).expect("the model folder").flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            evict_file(&path);
        }
    }
}

#[cfg(target_os = "linux")]
fn evict_file(path: &Path) {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).expect("a weights file");
    // SAFETY: advice on an open descriptor; it changes only the cache.
    let done = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(done, 0, "posix_fadvise(DONTNEED) on {}", path.display());
}

#[cfg(not(target_os = "linux"))]
fn evict_file(path: &Path) {
    eprintln!(
        "expert_reads: cannot drop {} from the page cache here: 'cold' is warm",
        path.display()
    );
}

/// Seconds to read `plan` with `method`, on a fresh open of the files.
fn run(dir: &Path, plan: &[Vec<(String, usize)>], method: Method) -> f64 {
    let set = SafetensorsSet::open_dir(dir).expect("the model's weights");
    for file in set.files() {
        file.advise_random_reads();
    }
    let largest = plan
        .iter()
        .flatten()
        .map(|(key, _)| {
            let view = set.tensor(key).expect("a planned tensor");
            view.data.len() / view.shape[0]
        })
        .max()
        .unwrap_or(0);
    let mut reused = vec![0u8; largest];
    let mut checksum = 0u64;
    let start = Instant::now();
    for (s, step) in plan.iter().enumerate() {
        match (method, plan.get(s + 1)) {
            (Method::PreadAskedAhead, Some(next)) => ask_ahead(&set, next),
            (Method::PreadAskedFirst, _) => ask_ahead(&set, step),
            _ => {}
        }
        for (key, e) in step {
            checksum = checksum.wrapping_add(read(&set, key, *e, method, &mut reused));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    // Read, so that no copy can be skipped.
    std::hint::black_box(checksum);
    seconds
}

/// Expert `e` of stack `key` read as `method` reads; a byte of it.
fn read(set: &SafetensorsSet, key: &str, e: usize, method: Method, reused: &mut [u8]) -> u64 {
    let view = set.tensor(key).expect("a planned tensor");
    let per_expert = view.data.len() / view.shape[0];
    match method {
        Method::PreadFresh => {
            let mut fresh = vec![0u8; per_expert];
            assert!(set
                .read_rows_into(key, e..e + 1, &mut fresh)
                .expect("a read"));
            u64::from(fresh[per_expert / 2])
        }
        Method::PreadReused | Method::PreadAskedAhead | Method::PreadAskedFirst => {
            let out = &mut reused[..per_expert];
            assert!(set.read_rows_into(key, e..e + 1, out).expect("a read"));
            u64::from(out[per_expert / 2])
        }
        Method::MapCopy => {
            let out = &mut reused[..per_expert];
            out.copy_from_slice(&view.data[e * per_expert..(e + 1) * per_expert]);
            u64::from(out[per_expert / 2])
        }
    }
}

/// Asks the files for every expert of `step`
/// ([`SafetensorsSet::advise_will_read`]: Linux's `WILLNEED`, macOS's
/// `F_RDADVISE`).
fn ask_ahead(set: &SafetensorsSet, step: &[(String, usize)]) {
    for (key, e) in step {
        set.advise_will_read(key, *e..e + 1)
            .expect("a planned expert");
    }
}
