//! The adapters an engine is given, opened at load: those fused into
//! streamed layers as they are read (`EngineConfig::adapter`,
//! `EngineConfig::lora`), and those kept unfused and chosen per request
//! (`EngineConfig::named_adapter`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use block_stream::BlockLoraSource;

use crate::distributed::identity;
use crate::error::{EngineError, Error};
use crate::models::checkpoint::Checkpoint;
use crate::models::Model;
use crate::weights::row_lora::RowAdapters;

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

/// The adapters served per row, opened; `None` without any. Serving runs
/// in one process: with ranks they are refused.
pub(crate) fn per_row(
    named: &[(String, PathBuf)],
    distributed: bool,
) -> Result<Option<Arc<RowAdapters>>, EngineError> {
    if named.is_empty() {
        return Ok(None);
    }
    if distributed {
        return Err(EngineError::InvalidConfig(
            "adapters chosen per request are served in one process, not with a distributed placement"
                .into(),
        ));
    }
    let adapters = RowAdapters::open(named).map_err(|e| EngineError::Load(Arc::new(e)))?;
    #[expect(
        clippy::arc_with_non_send_sync,
        reason = "held by the model and its layers, which stay with the worker (and its lanes, as the model does)"
    )]
    let adapters = Arc::new(adapters);
    Ok(Some(adapters))
}

/// Each per-row adapter's files as one digest (hex), in slot order: what
/// a prefix computed under it is bound to on disk, besides the engine's
/// binding.
pub(crate) fn digests(named: &[(String, PathBuf)]) -> crate::Result<Vec<String>> {
    named.iter().map(|(_, dir)| folder_digest(dir)).collect()
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
