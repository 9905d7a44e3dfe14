//! `FuseOptions`: where the cache is and how the hub is reached, passed
//! explicitly; the environment only supplies the defaults.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cache::cache_root_from;

/// How long a download may go without receiving a byte before it is
/// abandoned with [`Error::Stalled`](crate::Error::Stalled).
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Where [`ensure_fused`](crate::ensure_fused) keeps its cache and how it
/// reaches the hub.
///
/// [`FuseOptions::from_env`] reads what Python's huggingface_hub reads
/// (`HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`, `HF_HOME`, `HF_ENDPOINT`,
/// `HF_HUB_OFFLINE`, `HF_TOKEN`); each `with_*` method overrides one of
/// them, so a program (or a test) can point the fuse anywhere without
/// touching its process environment.
///
/// ```
/// use std::time::Duration;
/// use adapter_fuse::FuseOptions;
///
/// let options = FuseOptions::from_env()
///     .with_cache_root("/tmp/my-hub-cache")
///     .with_offline(true)
///     .with_stall_timeout(Duration::from_secs(30));
/// assert_eq!(options.cache_root(), std::path::Path::new("/tmp/my-hub-cache"));
/// ```
#[derive(Clone)]
pub struct FuseOptions {
    pub(crate) cache_root: PathBuf,
    pub(crate) endpoint: Option<String>,
    pub(crate) offline: bool,
    pub(crate) token: Option<String>,
    pub(crate) stall_timeout: Duration,
}

impl std::fmt::Debug for FuseOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a secret: say whether there is one, nothing more.
        f.debug_struct("FuseOptions")
            .field("cache_root", &self.cache_root)
            .field("endpoint", &self.endpoint)
            .field("offline", &self.offline)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("stall_timeout", &self.stall_timeout)
            .finish()
    }
}

impl FuseOptions {
    /// The defaults huggingface_hub would use in this process's environment.
    pub fn from_env() -> FuseOptions {
        FuseOptions::from_vars(|k| std::env::var_os(k))
    }

    /// [`from_env`](Self::from_env) with the variables looked up by `var`.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> FuseOptions {
        let text = |k: &str| var(k).and_then(|v| v.into_string().ok());
        FuseOptions {
            cache_root: cache_root_from(|k| var(k).map(PathBuf::from)),
            endpoint: text("HF_ENDPOINT").filter(|e| !e.is_empty()),
            offline: text("HF_HUB_OFFLINE").is_some_and(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "1" | "true" | "yes" | "on"
                )
            }),
            token: text("HF_TOKEN").filter(|t| !t.is_empty()),
            stall_timeout: DEFAULT_STALL_TIMEOUT,
        }
    }

    /// The hub cache folder (`.../hub`) to read bases from and write fused
    /// entries to.
    pub fn with_cache_root(mut self, root: impl Into<PathBuf>) -> FuseOptions {
        self.cache_root = root.into();
        self
    }

    /// The hub's address, e.g. a mirror (default `https://huggingface.co`).
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> FuseOptions {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// `true`: never ask the hub; a base missing from the cache is
    /// [`Error::Offline`](crate::Error::Offline).
    pub fn with_offline(mut self, offline: bool) -> FuseOptions {
        self.offline = offline;
        self
    }

    /// The access token for gated or private base repos.
    pub fn with_token(mut self, token: impl Into<String>) -> FuseOptions {
        self.token = Some(token.into());
        self
    }

    /// How long a download may receive nothing (connecting, waiting for the
    /// answer, or mid-body) before it fails with
    /// [`Error::Stalled`](crate::Error::Stalled). Default 60 s.
    pub fn with_stall_timeout(mut self, timeout: Duration) -> FuseOptions {
        self.stall_timeout = timeout;
        self
    }

    /// The hub cache folder in use.
    pub fn cache_root(&self) -> &Path {
        &self.cache_root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_give_the_defaults_and_methods_override_them() {
        let vars = |k: &str| {
            let v = match k {
                "HF_HUB_CACHE" => "/cache",
                "HF_ENDPOINT" => "http://127.0.0.1:9",
                "HF_HUB_OFFLINE" => "True",
                "HF_TOKEN" => "secret",
                _ => return None,
            };
            Some(v.into())
        };
        let o = FuseOptions::from_vars(vars);
        assert_eq!(o.cache_root(), Path::new("/cache"));
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:9"));
        assert!(o.offline);
        assert!(!format!("{o:?}").contains("secret"));
        let o = o.with_offline(false).with_cache_root("/other");
        assert!(!o.offline);
        assert_eq!(o.cache_root(), Path::new("/other"));
        let none = FuseOptions::from_vars(|k| (k == "HOME").then(|| "/h".into()));
        assert!(!none.offline);
        assert_eq!(none.endpoint, None);
        assert_eq!(none.cache_root(), Path::new("/h/.cache/huggingface/hub"));
    }
}
