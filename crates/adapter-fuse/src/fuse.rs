//! Fusing an adapter into a base model, shard by shard.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use mlx_rs::Array;
use mlx_support::{
    array_from_bytes, array_to_bytes, fuse_lora, unused_by_mlx_lm, LinearWeights, Lora, LoraLayout,
    Quantization, QuantizationConfig,
};
use st_mmap::{SafetensorsFile, SafetensorsSet, TensorInfo, TensorView};

use crate::error::{io, Error, Result};
use block_stream::MlxLmAdapter;

fn array(view: &TensorView<'_>) -> Result<Array> {
    array_from_bytes(view.name, view.dtype, view.shape, view.data).map_err(support_err)
}

/// An array of a base tensor, read with positioned reads instead of through
/// the map, so its pages do not stay in the resident set (see `write_shard`).
fn read_array(base: &SafetensorsSet, view: &TensorView<'_>) -> Result<Array> {
    let file = base
        .mapped_file_of(view.name)
        .expect("the view came from the set");
    let bytes = file.read_tensor(view.name)?.expect("indexed");
    array_from_bytes(view.name, view.dtype, view.shape, &bytes).map_err(support_err)
}

/// What fusing one module produces: new bytes for some of its tensors.
type Fused = HashMap<String, Vec<u8>>;

/// `W + ((scale · Bᵀ) @ Aᵀ).astype(W's dtype)`, in mlx_lm's order of
/// operations and dtypes (`LoRALinear.fuse` in mlx_lm 0.31), through the
/// workspace's one LoRA arithmetic (`mlx_support::fuse_lora`): quantized
/// weights are dequantized (to the scales' dtype), fused, and requantized
/// with the module's own group size and bits.
fn fuse_module(
    module: &str,
    adapter: &MlxLmAdapter,
    base: &SafetensorsSet,
    quant: Option<Quantization>,
) -> Result<Fused> {
    let _span = tracing::debug_span!("fuse_module", module).entered();
    let (a_key, b_key) = &adapter.pairs()[module];
    let a_view = adapter.file().tensor(a_key).expect("indexed");
    let b_view = adapter.file().tensor(b_key).expect("indexed");
    let weight_key = format!("{module}.weight");
    let w_view = base
        .tensor(&weight_key)
        .ok_or_else(|| Error::NoBaseWeight {
            key: a_key.clone(),
            weight: weight_key.clone(),
        })?;
    let scales_key = format!("{module}.scales");
    let biases_key = format!("{module}.biases");
    let scales_view = quant.and_then(|_| base.tensor(&scales_key));
    let stored = LinearWeights {
        weight: read_array(base, &w_view)?,
        scales: scales_view.map(|v| read_array(base, &v)).transpose()?,
        biases: match scales_view {
            Some(_) => base
                .tensor(&biases_key)
                .map(|v| read_array(base, &v))
                .transpose()?,
            None => None,
        },
    };
    let (a, b) = (array(&a_view)?, array(&b_view)?);
    let lora = Lora {
        a: &a,
        b: &b,
        scale: adapter.scale(),
        layout: LoraLayout::MlxLm,
    };
    let fused = fuse_lora(&stored, quant, lora).map_err(|e| match e {
        mlx_support::Error::LoraShape { a, b, weight, .. } => Error::ShapeMismatch {
            key: a_key.clone(),
            weight: weight_key.clone(),
            a,
            b,
            base: weight,
        },
        other => support_err(other),
    })?;
    // A NaN in the adapter, or a product that overflows the weight's dtype,
    // would be written silently and make every answer of the model empty.
    if !fused.is_finite().map_err(support_err)? {
        return Err(Error::NotFinite {
            module: module.to_owned(),
            weight: weight_key,
        });
    }
    let mut out = Fused::new();
    out.insert(weight_key, bytes(&fused.weight)?);
    if let Some(scales) = &fused.scales {
        out.insert(scales_key, bytes(scales)?);
    }
    if let Some(biases) = &fused.biases {
        out.insert(biases_key, bytes(biases)?);
    }
    Ok(out)
}

fn bytes(array: &Array) -> Result<Vec<u8>> {
    array_to_bytes(array).map_err(support_err)
}

fn support_err(e: mlx_support::Error) -> Error {
    match e {
        mlx_support::Error::Mlx(e) => Error::Mlx(e),
        other => Error::Tensor(other),
    }
}

/// What the writer thread puts into a shard next.
enum Piece {
    /// Bytes of the base file, copied as they are.
    Copy { at: u64, len: u64 },
    /// A fused tensor.
    Bytes(Vec<u8>),
}

/// How many fused tensors may wait for the writer: enough to keep it busy,
/// few enough to keep memory near one module.
const QUEUED_PIECES: usize = 2;

/// Writes one output shard: the base header verbatim, each tensor either
/// copied from the base file or replaced by its fused bytes (same dtype,
/// shape and length, so the header stays valid).
///
/// A writer thread does the file I/O while this thread (the one that owns
/// MLX) fuses the next module: on a large model the copying and the
/// matrix products take about as long as each other. Untouched tensors are
/// copied with positioned I/O rather than through the map (mapped pages that
/// were read stay in the resident set until the map goes, so copying a
/// model through its map would make the process as large as the model).
fn write_shard(
    file: &SafetensorsFile,
    out: &Path,
    keep: &dyn Fn(&str) -> bool,
    fused: &mut dyn FnMut(&str) -> Result<Option<Vec<u8>>>,
) -> Result<Vec<TensorInfo>> {
    let header = file.header();
    let source = fs::File::open(file.path()).map_err(io(file.path()))?;
    let target = fs::File::create(out).map_err(io(out))?;
    // The base's header verbatim, or one for the tensors kept.
    let (head, kept) = if header.tensors().iter().all(|t| keep(&t.name)) {
        let head = file.bytes()[..header.data_start()].to_vec();
        (head, header.tensors().to_vec())
    } else {
        header.subset(|t| keep(&t.name))
    };
    let head = head.as_slice();
    let (tx, rx) = std::sync::mpsc::sync_channel::<Piece>(QUEUED_PIECES);
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| write_pieces(head, &source, file.path(), target, out, rx));
        let produced = (|| {
            // A `false` from `send` means the writer failed: its error follows.
            let send = |piece| tx.send(piece).is_ok();
            // Untouched bytes not sent yet: neighbouring tensors are one copy.
            let mut copy: Option<(u64, u64)> = None;
            for info in header.tensors().iter().filter(|t| keep(&t.name)) {
                let at = (header.data_start() + info.data_offsets.0) as u64;
                let len = info.byte_len() as u64;
                match fused(&info.name)? {
                    None => match copy {
                        Some((start, n)) if start + n == at => copy = Some((start, n + len)),
                        pending => {
                            if !pending.is_none_or(|(at, len)| send(Piece::Copy { at, len })) {
                                return Ok(());
                            }
                            copy = Some((at, len));
                        }
                    },
                    Some(bytes) => {
                        assert_eq!(
                            bytes.len(),
                            info.byte_len(),
                            "{}: fused size differs",
                            info.name
                        );
                        let flushed = copy
                            .take()
                            .is_none_or(|(at, len)| send(Piece::Copy { at, len }));
                        if !(flushed && send(Piece::Bytes(bytes))) {
                            return Ok(());
                        }
                    }
                }
            }
            if let Some((at, len)) = copy {
                send(Piece::Copy { at, len });
            }
            Ok(())
        })();
        drop(tx);
        let written = writer
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        produced.and(written)
    })?;
    Ok(kept)
}

/// The writer thread: the header, then each piece in order. Synced with the
/// rest of the folder at the end (`sync_files`).
fn write_pieces(
    head: &[u8],
    source: &fs::File,
    source_path: &Path,
    target: fs::File,
    out: &Path,
    pieces: std::sync::mpsc::Receiver<Piece>,
) -> Result<()> {
    let mut w = BufWriter::with_capacity(1 << 20, target);
    w.write_all(head).map_err(io(out))?;
    for piece in pieces {
        match piece {
            Piece::Bytes(bytes) => w.write_all(&bytes).map_err(io(out))?,
            Piece::Copy { at, len } => {
                // `io::copy` from a file range: on Linux std makes this a
                // `copy_file_range` (no copy through user space);
                // elsewhere it reads straight into the writer's buffer.
                let mut reader = source;
                reader.seek(SeekFrom::Start(at)).map_err(io(source_path))?;
                let copied = std::io::copy(&mut reader.take(len), &mut w).map_err(io(out))?;
                if copied != len {
                    return Err(Error::Io {
                        path: source_path.to_path_buf(),
                        source: std::io::ErrorKind::UnexpectedEof.into(),
                    });
                }
            }
        }
    }
    w.into_inner().map_err(|e| Error::Io {
        path: out.to_path_buf(),
        source: e.into_error(),
    })?;
    Ok(())
}

/// Fuses `adapter` into the model in `base_dir`, writing a complete model
/// folder to `out`. `progress(done, total)` counts modules.
pub(crate) fn fuse_model(
    base_dir: &Path,
    adapter: &MlxLmAdapter,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    let config_path = base_dir.join("config.json");
    let config_text = fs::read_to_string(&config_path).map_err(io(&config_path))?;
    let mut config: serde_json::Value =
        serde_json::from_str(&config_text).map_err(|e| Error::Json {
            path: config_path.clone(),
            message: e.to_string(),
        })?;
    let quant = QuantizationConfig::from_model_config(&config).map_err(|e| Error::Json {
        path: config_path.clone(),
        message: e.to_string(),
    })?;
    let base = SafetensorsSet::open_dir(base_dir)?;
    // What Python's fuse leaves out: mlx_lm never loads these tensors
    // (towers, unused k/v), so its saved model has none of them.
    let keep = |key: &str| !unused_by_mlx_lm(&config, key);

    // Which module each base tensor belongs to, for the tensors fusing touches.
    let mut touched: HashMap<String, String> = HashMap::new();
    for module in adapter.pairs().keys() {
        let weight = format!("{module}.weight");
        if base.tensor(&weight).is_none() {
            return Err(Error::NoBaseWeight {
                key: adapter.pairs()[module].0.clone(),
                weight,
            });
        }
        for suffix in ["weight", "scales", "biases"] {
            touched.insert(format!("{module}.{suffix}"), module.clone());
        }
    }
    fs::create_dir_all(out).map_err(io(out))?;
    let total = adapter.pairs().len();
    let mut done = 0;
    let mut pending: HashMap<String, Vec<u8>> = HashMap::new();
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    for file in base.files() {
        if !file.header().tensors().iter().any(|t| keep(&t.name)) {
            continue;
        }
        let name = file.path().file_name().expect("a file").to_owned();
        let target = out.join(&name);
        let kept = write_shard(file, &target, &keep, &mut |key| {
            if let Some(bytes) = pending.remove(key) {
                return Ok(Some(bytes));
            }
            let Some(module) = touched.get(key) else {
                return Ok(None);
            };
            let mut fused = fuse_module(module, adapter, &base, quant.of(module))?;
            done += 1;
            progress(done, total);
            let mine = fused.remove(key);
            pending.extend(fused);
            Ok(mine)
        })?;
        for info in &kept {
            weight_map.insert(info.name.clone(), name.to_string_lossy().into_owned());
            total_size += info.byte_len() as u64;
        }
    }
    // Every fused tensor must have been written: a module's tensors are all
    // fused when the first of them is reached, and the rest are written
    // from `pending` when their turn comes.
    if let Some(key) = pending.keys().next() {
        return Err(Error::Adapter {
            path: base_dir.to_path_buf(),
            message: format!("fused {key:?} but the base has no place for it"),
        });
    }

    st_mmap::ShardIndex::new(weight_map, total_size).write(&out.join(st_mmap::INDEX_FILE))?;
    // As mlx_lm's `save_config` writes it: the quantization under both
    // names, without the source's path or the vision config (whose tower
    // is left out above).
    if let Some(q) = config.get("quantization").cloned() {
        config["quantization_config"] = q;
    }
    if let Some(fields) = config.as_object_mut() {
        fields.remove("_name_or_path");
        fields.remove("vision_config");
    }
    let out_config = out.join("config.json");
    fs::write(
        &out_config,
        serde_json::to_vec_pretty(&st_mmap::json::sorted(&config)).expect("json"),
    )
    .map_err(io(&out_config))?;
    copy_other_files(base_dir, out)?;
    sync_files(out)
}

/// Makes every file in `dir` durable. Once, at the end, rather than after
/// each file: the kernel writes shards back while later ones are fused, and
/// only what is still dirty is waited for here.
fn sync_files(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        // Write access where possible: Windows flushes only handles that
        // can write. A copied read-only file (`fs::copy` keeps the mode)
        // is synced through a read handle, which Unix allows.
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .or_else(|_| fs::File::open(&path))
            .and_then(|f| f.sync_all())
            .map_err(io(&path))?;
    }
    Ok(())
}

/// Copies everything else a loader needs (tokenizer, generation config, chat
/// template, …), following the cache's symlinks to real files.
fn copy_other_files(base_dir: &Path, out: &Path) -> Result<()> {
    for entry in fs::read_dir(base_dir).map_err(io(base_dir))?.flatten() {
        let name = entry.file_name();
        let text = name.to_string_lossy();
        let skip = text.ends_with(".safetensors")
            || text == st_mmap::INDEX_FILE
            || text == "config.json"
            || text.starts_with('.');
        let path = entry.path();
        if skip || !path.is_file() {
            continue;
        }
        let target = out.join(&name);
        fs::copy(&path, &target).map_err(io(&path))?;
    }
    Ok(())
}
