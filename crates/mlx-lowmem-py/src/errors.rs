//! Rust errors as the Python exceptions of `mlx_lowmem._errors`.
//!
//! The classes are defined in Python (each derives from `MlxLowmemError`
//! and from the builtin the originals raise in that case, e.g.
//! `ValueError`), so that they pickle, print and subclass as Python users
//! expect; this module only picks the class and passes the Rust message,
//! which names the file, key or conversation.

use pyo3::prelude::*;

/// The exception class `name` of `mlx_lowmem._errors` raised with
/// `message`; if that module cannot be imported (a broken install), the
/// import's own error, which says why.
pub(crate) fn raise(name: &str, message: impl std::fmt::Display) -> PyErr {
    Python::attach(|py| {
        let made = py
            .import("mlx_lowmem._errors")
            .and_then(|m| m.getattr(name))
            .and_then(|class| class.call1((message.to_string(),)));
        match made {
            Ok(exception) => PyErr::from_value(exception),
            Err(e) => e,
        }
    })
}

/// The class for an engine error.
pub(crate) fn engine(error: &mlx_engine::EngineError) -> PyErr {
    use mlx_engine::EngineError as E;
    let class = match error {
        E::Closed => "EngineClosedError",
        E::Load(_) => "LoadError",
        E::InvalidConfig(_) | E::UnknownAdapter(_) | E::InvalidRequest(_) => "ConfigError",
        E::PrefixMismatch { .. } | E::NothingAfterPrefix { .. } | E::PromptTooLong { .. } => {
            "ConversationError"
        }
        E::PeerTimeout { .. } => "PeerTimeoutError",
        E::AdapterLoad(_) | E::AdapterInUse { .. } => "AdapterError",
        _ => "GenerationError",
    };
    raise(class, error)
}

/// The class for a codec error.
pub(crate) fn codec(error: &adapter_codec::Error) -> PyErr {
    raise("CodecError", error)
}

/// The class for a fuse error.
pub(crate) fn fuse(error: &adapter_fuse::Error) -> PyErr {
    let class = match error {
        adapter_fuse::Error::Offline { .. } => "OfflineError",
        _ => "FuseError",
    };
    raise(class, error)
}
