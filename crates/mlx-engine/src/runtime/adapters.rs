//! The adapters an engine is given, opened at load: those fused into
//! streamed layers as they are read (`EngineConfig::adapter`,
//! `EngineConfig::lora`), and those kept unfused and chosen per request
//! (`EngineConfig::named_adapter`, `MlxEngine::load_adapter`), which may
//! also be the adapter codec's compressed file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use adapter_codec::AdapterCodec;
use block_stream::BlockLoraSource;

use crate::distributed::identity;
use crate::error::{EngineError, Error};
use crate::models::checkpoint::Checkpoint;
use crate::models::Model;
use crate::weights::row_lora::{AdapterSpec, RowAdapters};

/// The streamed layers' sources: `lora` as given, then each mlx_lm folder
/// of `dirs` under the model's layer prefix.
pub(crate) fn on_the_fly(
    checkpoint: &Checkpoint,
    dirs: &[PathBuf],
    mut lora: Vec<BlockLoraSource>,
) -> crate::Result<Vec<BlockLoraSource>> {
    let prefix = checkpoint.block_prefix();
    for dir in dirs {
        let source = block_stream::MlxLmAdapter::open(dir)
            .and_then(|a| a.into_block_source(prefix.as_str()))
            .map_err(|source| Error::Stream {
                dir: dir.clone(),
                source: Box::new(source),
            })?;
        lora.push(source);
    }
    Ok(lora)
}

/// The adapters served per row, opened (`named`, with their files'
/// digests when `digests`, for a prefix folder); `None` with ranks:
/// serving runs in one process. Without ranks an engine serves per-row
/// adapters even if none is named at its start, so that adapters can be
/// loaded later ([`load`]).
pub(crate) fn per_row(
    named: &[(String, PathBuf)],
    digests: bool,
    distributed: bool,
) -> Result<Option<Arc<RowAdapters>>, EngineError> {
    if distributed {
        if named.is_empty() {
            return Ok(None);
        }
        return Err(EngineError::InvalidConfig(
            "adapters chosen per request are served in one process, not with a distributed placement"
                .into(),
        ));
    }
    let load_err = |e| EngineError::Load(Arc::new(e));
    let adapters = RowAdapters::new().map_err(load_err)?;
    let mut decoded = Vec::new();
    let specs = specs(named, digests, &mut decoded).map_err(load_err)?;
    adapters.add(&specs).map_err(load_err)?;
    #[expect(
        clippy::arc_with_non_send_sync,
        reason = "held by the model and its layers, which stay with the worker (and its lanes, as the model does)"
    )]
    let adapters = Arc::new(adapters);
    Ok(Some(adapters))
}

/// `named` as adapters to serve, each with its files' digest when
/// `digests`; those the codec ships are decoded into `decoded`, which
/// must outlive their load.
fn specs(
    named: &[(String, PathBuf)],
    digests: bool,
    decoded: &mut Vec<tempfile::TempDir>,
) -> crate::Result<Vec<AdapterSpec>> {
    let mut specs = Vec::with_capacity(named.len());
    for (name, dir) in named {
        let (folder, shown) = match shipped(dir) {
            None => {
                let shown = (
                    dir.join("adapter_config.json"),
                    dir.join("adapters.safetensors"),
                );
                (dir.clone(), shown)
            }
            Some(codec) => {
                let work = decode(&codec)?;
                let folder = work.path().to_path_buf();
                decoded.push(work);
                let shown = (codec.config_path().into(), codec.zst_path().into());
                (folder, shown)
            }
        };
        // The decoded bytes equal the original's: a prefix kept under the
        // folder is found again under the compressed file.
        let digest = digests.then(|| folder_digest(&folder)).transpose()?;
        specs.push(AdapterSpec {
            name: name.clone(),
            dir: dir.clone(),
            folder,
            shown,
            digest,
        });
    }
    Ok(specs)
}

/// The adapter codec's files `dir` names, if it names them: the `.zst`
/// itself or a folder holding `adapters.safetensors.zst` and no
/// `adapters.safetensors`, with `adapter_config.json` beside it.
fn shipped(dir: &Path) -> Option<AdapterCodec> {
    let zst = match dir.extension().is_some_and(|e| e == "zst") {
        true => dir.to_path_buf(),
        false if dir.join("adapters.safetensors").exists() => return None,
        false => dir.join("adapters.safetensors.zst"),
    };
    let config = zst.parent()?.join("adapter_config.json");
    zst.is_file().then(|| AdapterCodec::new(zst, config))
}

/// The codec's adapter decoded into a temporary mlx_lm folder (checked
/// against the digest it was shipped with).
fn decode(codec: &AdapterCodec) -> crate::Result<tempfile::TempDir> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| adapter_codec::Error::Io { path, source }
    };
    let work = tempfile::Builder::new()
        .prefix("mlx-lowmem-adapter-")
        .tempdir()
        .map_err(io(&std::env::temp_dir()))?;
    codec.decode(work.path().join("adapters.safetensors"))?;
    let config = work.path().join("adapter_config.json");
    std::fs::write(&config, codec.config_bytes()?).map_err(io(&config))?;
    Ok(work)
}

/// Serves the adapter in `dir` as `name` from the next forward on
/// (`MlxEngine::load_adapter`); `digests` as for [`per_row`].
pub(crate) fn load(
    model: &Model,
    name: String,
    dir: PathBuf,
    digests: bool,
) -> Result<(), EngineError> {
    let adapters = served_by(model)?;
    if name.is_empty() || name.contains(':') {
        return Err(EngineError::InvalidRequest(format!(
            "adapter name {name:?}: not empty, no ':'"
        )));
    }
    let load_err = |e| EngineError::AdapterLoad(Arc::new(e));
    let mut decoded = Vec::new();
    let specs = specs(&[(name, dir)], digests, &mut decoded).map_err(load_err)?;
    adapters.add(&specs).map_err(load_err)?;
    // What the load copied out of the files and freed (transients of
    // the stacking) would otherwise stay resident.
    mlx_support::release_free_memory();
    Ok(())
}

/// Stops serving the adapter `name`; returns its slot.
pub(crate) fn unload(model: &Model, name: &str) -> Result<usize, EngineError> {
    let adapters = served_by(model)?;
    let slot = adapters
        .remove(name)
        .map_err(|e| EngineError::AdapterLoad(Arc::new(e)))?
        .ok_or_else(|| EngineError::UnknownAdapter(name.to_owned()))?;
    mlx_support::release_free_memory();
    Ok(slot)
}

/// The per-row adapters of `model`; with ranks there are none.
pub(crate) fn served_by(model: &Model) -> Result<&RowAdapters, EngineError> {
    model.row_adapters().ok_or_else(|| {
        EngineError::InvalidConfig(
            "adapters chosen per request are served in one process, not with a distributed placement"
                .into(),
        )
    })
}

/// An mlx_lm adapter folder's files as one digest (hex).
pub(crate) fn folder_digest(dir: &Path) -> crate::Result<String> {
    let files = ["adapter_config.json", "adapters.safetensors"].map(|f| dir.join(f));
    identity::files_digest(&files)
}

/// The slot of the per-row adapter `name`, if a request names one.
pub(crate) fn slot_of(model: &Model, name: Option<&str>) -> Result<Option<usize>, EngineError> {
    let Some(name) = name else {
        return Ok(None);
    };
    model
        .row_adapters()
        .and_then(|a| a.slot(name))
        .map(Some)
        .ok_or_else(|| EngineError::UnknownAdapter(name.to_owned()))
}
