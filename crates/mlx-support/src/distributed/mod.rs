//! MLX's distributed engine (`mlx::core::distributed`) on `mlx_rs::Array`:
//! a [`Group`] of ranks and its collectives, through mlx-c. The transport is
//! MLX's own — the TCP ring built into every MLX, MPI where installed, JACCL
//! (RDMA over Thunderbolt) on macOS — so a rank written with this module and
//! a rank running Python's `mlx` form one job.
//!
//! A job's ranks are started with `MLX_RANK` (0-based) and `MLX_HOSTFILE`
//! (see [`Hostfile`]) in their environment, by `cargo xtask launch` or by
//! Python's `mlx.launch`. A program started without them gets a one-rank
//! group whose collectives return their input, so code written for a group
//! runs unchanged on one machine.
//!
//! ```
//! use mlx_support::distributed::{Backend, Group};
//! # fn main() -> Result<(), mlx_support::distributed::DistributedError> {
//! let group = Group::single();
//! let x = mlx_rs::Array::from_slice(&[1.0f32, 2.0], &[2]);
//! let sum = group.all_sum(&x)?;
//! assert_eq!(sum.as_slice::<f32>(), &[1.0, 2.0]);
//! # let _ = Backend::Ring;
//! # Ok(())
//! # }
//! ```
//!
//! Communication is lazy like every MLX operation: the returned arrays
//! communicate when they are evaluated, and an evaluation that loses its
//! peer fails with MLX's "connection to a peer was lost". MLX's own waits
//! have no deadline (a peer that never connects is waited for forever), so
//! [`Group::init`] waits for its peers at most [`GroupConfig::timeout`].

mod ffi;
mod hostfile;
mod launch;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mlx_rs::{Array, Dtype, StreamOrDevice};

pub use hostfile::Hostfile;
pub use launch::{Launch, LaunchError, RankExit};

/// Which of MLX's distributed backends to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// The first MLX finds configured (NCCL, ring, MPI, JACCL in MLX's order).
    Any,
    /// TCP sockets in a ring: built into every MLX; Ethernet or
    /// Thunderbolt between Macs.
    Ring,
    /// MPI, loaded at run time where an MPI library is installed.
    Mpi,
    /// RDMA over Thunderbolt 5 (macOS).
    Jaccl,
    /// NVIDIA's collectives (CUDA builds of MLX).
    Nccl,
}

impl Backend {
    /// The name MLX gives the backend.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Any => "any",
            Backend::Ring => "ring",
            Backend::Mpi => "mpi",
            Backend::Jaccl => "jaccl",
            Backend::Nccl => "nccl",
        }
    }

    /// Whether this MLX was built with the backend (and, for MPI, found
    /// the library).
    pub fn is_available(self) -> bool {
        let name = std::ffi::CString::new(self.name()).unwrap_or_default();
        // SAFETY: a NUL-terminated name valid for the call.
        unsafe { mlx_sys::mlx_distributed_is_available(name.as_ptr()) }
    }
}

/// Why a group could not be formed or used. Errors of a communication
/// that fails when evaluated come from MLX's evaluation instead (see the
/// module docs).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistributedError {
    /// The hostfile cannot be read or is not MLX's format.
    #[error("hostfile {path:?}: {reason}")]
    Hostfile { path: PathBuf, reason: String },
    /// `MLX_RANK` / `MLX_HOSTFILE` are set in a way that cannot work.
    #[error("{variable}={value:?}: {reason}")]
    Environment {
        variable: &'static str,
        value: String,
        reason: String,
    },
    /// A rank beyond the hostfile's ranks.
    #[error("rank {rank} is out of range: the hostfile names {size} ranks (0..{size})")]
    RankOutOfRange { rank: usize, size: usize },
    /// A send or receive naming a peer that is not another rank of the group.
    #[error("rank {rank} of {size} cannot exchange with rank {peer}")]
    Peer {
        rank: usize,
        peer: usize,
        size: usize,
    },
    /// The backend is not in this MLX.
    #[error("MLX's {} backend is not available here", backend.name())]
    Unavailable { backend: Backend },
    /// MLX could not form the group (e.g. a peer's port refused every
    /// connection).
    #[error("rank {rank}: MLX's {} backend could not form the group: {message}", backend.name())]
    Init {
        rank: usize,
        backend: Backend,
        message: String,
    },
    /// The peers did not all connect in time.
    #[error("rank {rank} of {size}: the group did not form within {waited:?} (a peer never connected; is every rank started, and is every port in the hostfile free?)")]
    InitTimeout {
        rank: usize,
        size: usize,
        waited: Duration,
    },
    /// MLX refused an operation on the group.
    #[error("rank {rank}: {operation}: {message}")]
    Operation {
        rank: usize,
        operation: &'static str,
        message: String,
    },
}

type Result<T> = std::result::Result<T, DistributedError>;

/// How to form a group: the rank, the hostfile, the backend and how long
/// to wait for the peers.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    backend: Backend,
    ranks: Option<(usize, PathBuf)>,
    timeout: Duration,
}

/// How long [`Group::init`] waits for its peers unless told otherwise.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(60);

impl GroupConfig {
    /// The rank and hostfile from `MLX_RANK` and `MLX_HOSTFILE`; with
    /// neither set, a one-rank group.
    pub fn from_env() -> Result<GroupConfig> {
        let rank = std::env::var("MLX_RANK").ok();
        let hostfile = std::env::var_os("MLX_HOSTFILE").map(PathBuf::from);
        let ranks = match (rank, hostfile) {
            (None, None) => None,
            (Some(rank), Some(hostfile)) => {
                let rank = rank
                    .trim()
                    .parse()
                    .map_err(|_| DistributedError::Environment {
                        variable: "MLX_RANK",
                        value: rank.clone(),
                        reason: "not a rank number".to_owned(),
                    })?;
                Some((rank, hostfile))
            }
            (Some(rank), None) => {
                return Err(DistributedError::Environment {
                    variable: "MLX_RANK",
                    value: rank,
                    reason: "set without MLX_HOSTFILE".to_owned(),
                })
            }
            (None, Some(hostfile)) => {
                return Err(DistributedError::Environment {
                    variable: "MLX_HOSTFILE",
                    value: hostfile.display().to_string(),
                    reason: "set without MLX_RANK".to_owned(),
                })
            }
        };
        Ok(GroupConfig {
            backend: Backend::Any,
            ranks,
            timeout: DEFAULT_INIT_TIMEOUT,
        })
    }

    /// Rank `rank` of the job `hostfile` describes. MLX reads both from the
    /// environment only, so [`Group::init`] writes them there: form the
    /// group before starting threads that read the environment.
    pub fn explicit(rank: usize, hostfile: impl Into<PathBuf>) -> GroupConfig {
        GroupConfig {
            backend: Backend::Ring,
            ranks: Some((rank, hostfile.into())),
            timeout: DEFAULT_INIT_TIMEOUT,
        }
    }

    /// How many ranks of the job run on this rank's host (1 without a
    /// job): ranks on one machine share its cores, so each should give its
    /// BLAS library its share (see `mlx_support::set_blas_threads`).
    pub fn ranks_on_this_host(&self) -> Result<usize> {
        match &self.ranks {
            None => Ok(1),
            Some((rank, path)) => Ok(Hostfile::read(path)?.ranks_on_host_of(*rank)),
        }
    }

    /// Chooses the backend ([`Backend::Any`] from the environment,
    /// [`Backend::Ring`] for an explicit hostfile).
    pub fn backend(mut self, backend: Backend) -> GroupConfig {
        self.backend = backend;
        self
    }

    /// How long to wait for every peer to connect
    /// ([`DEFAULT_INIT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> GroupConfig {
        self.timeout = timeout;
        self
    }
}

/// A handle to an MLX group.
struct Raw(mlx_sys::mlx_distributed_group);

// SAFETY: the handle owns a heap `mlx::core::distributed::Group` (a
// shared pointer to the backend's group). MLX's own Python binding shares
// groups between threads; the backend serialises its sockets itself.
unsafe impl Send for Raw {}
// SAFETY: as above; rank, size and the operations only read the group.
unsafe impl Sync for Raw {}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: the handle was made by mlx_distributed_init or _split and
        // is freed once, here.
        unsafe { mlx_sys::mlx_distributed_group_free(self.0) };
    }
}

/// A group of ranks: one process each, on one or several machines.
/// Cloning shares the group.
#[derive(Clone)]
pub struct Group {
    raw: Option<Arc<Raw>>,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {})", self.rank, self.size)
    }
}

impl Group {
    /// The group of this process alone: collectives return their input.
    pub fn single() -> Group {
        Group {
            raw: None,
            rank: 0,
            size: 1,
        }
    }

    /// Forms the group `config` describes, waiting at most its timeout for
    /// the peers. A config without ranks gives [`Group::single`].
    ///
    /// When the wait times out, the thread MLX is connecting on cannot be
    /// stopped: it stays blocked until the process exits, which a rank
    /// given this error should do.
    pub fn init(config: &GroupConfig) -> Result<Group> {
        let Some((rank, path)) = &config.ranks else {
            return Ok(Group::single());
        };
        let hostfile = Hostfile::read(path)?;
        let (rank, size) = (*rank, hostfile.size());
        if rank >= size {
            return Err(DistributedError::RankOutOfRange { rank, size });
        }
        if size == 1 {
            return Ok(Group::single());
        }
        let backend = config.backend;
        if !backend.is_available() {
            return Err(DistributedError::Unavailable { backend });
        }
        set_env_if_different("MLX_RANK", &rank.to_string());
        set_env_if_different("MLX_HOSTFILE", &path.display().to_string());
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        // MLX connects to the peers inside init and waits without a
        // deadline; the wait runs on its own thread so that it can be
        // bounded here.
        let spawned = std::thread::Builder::new()
            .name("mlx-distributed-init".to_owned())
            .spawn(move || {
                let name = std::ffi::CString::new(backend.name()).unwrap_or_default();
                // SAFETY: a fresh empty handle, filled by init.
                let mut raw = Raw(unsafe { mlx_sys::mlx_distributed_group_new() });
                let made = ffi::checked(|| {
                    // SAFETY: `raw.0` is a valid handle to fill; `name` is
                    // NUL-terminated and lives across the call.
                    unsafe { mlx_sys::mlx_distributed_init(&mut raw.0, true, name.as_ptr()) }
                });
                let _ = tx.send(made.map(|()| raw));
            });
        if let Err(e) = spawned {
            return Err(DistributedError::Init {
                rank,
                backend,
                message: format!("cannot start the thread that connects: {e}"),
            });
        }
        let raw = match rx.recv_timeout(config.timeout) {
            Ok(Ok(raw)) => raw,
            Ok(Err(message)) => {
                return Err(DistributedError::Init {
                    rank,
                    backend,
                    message,
                })
            }
            Err(_) => {
                return Err(DistributedError::InitTimeout {
                    rank,
                    size,
                    waited: config.timeout,
                })
            }
        };
        let group = Group::from_raw(raw)?;
        if (group.rank, group.size) != (rank, size) {
            return Err(DistributedError::Init {
                rank,
                backend,
                message: format!(
                    "MLX formed rank {} of {}, the hostfile says rank {rank} of {size}",
                    group.rank, group.size
                ),
            });
        }
        Ok(group)
    }

    /// [`Group::init`] from `MLX_RANK` and `MLX_HOSTFILE`.
    pub fn from_env() -> Result<Group> {
        Group::init(&GroupConfig::from_env()?)
    }

    fn from_raw(raw: Raw) -> Result<Group> {
        let mut rank = 0;
        let mut size = 0;
        ffi::checked(|| {
            // SAFETY: `raw.0` is a formed group.
            rank = unsafe { mlx_sys::mlx_distributed_group_rank(raw.0) };
            // SAFETY: as above.
            size = unsafe { mlx_sys::mlx_distributed_group_size(raw.0) };
            0
        })
        .map_err(|message| DistributedError::Operation {
            rank: 0,
            operation: "rank and size",
            message,
        })?;
        Ok(Group {
            raw: Some(Arc::new(raw)),
            rank: usize::try_from(rank).unwrap_or(0),
            size: usize::try_from(size).unwrap_or(1),
        })
    }

    /// This process's rank, 0-based.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the group has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether this is the one-rank group.
    pub fn is_single(&self) -> bool {
        self.size == 1
    }

    /// Splits the group: ranks passing the same `color` form a new group,
    /// ordered by `key` (their rank when `None`). MLX's ring backend does
    /// not split groups (its error comes back); MPI does.
    pub fn split(&self, color: u32, key: Option<usize>) -> Result<Group> {
        let Some(raw) = &self.raw else {
            return Ok(Group::single());
        };
        let key = key.map_or(-1, |k| i32::try_from(k).unwrap_or(i32::MAX));
        // SAFETY: a fresh empty handle, filled by split.
        let mut out = Raw(unsafe { mlx_sys::mlx_distributed_group_new() });
        ffi::checked(|| {
            // SAFETY: both handles are valid; `out` is filled.
            unsafe {
                mlx_sys::mlx_distributed_group_split(
                    &mut out.0,
                    raw.0,
                    i32::try_from(color).unwrap_or(i32::MAX),
                    key,
                )
            }
        })
        .map_err(|message| self.refused("split", message))?;
        Group::from_raw(out)
    }

    /// The element-wise sum of `x` over every rank (same shape everywhere).
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        self.collective("all_sum", x, |res, x, g, s| {
            // SAFETY: valid handles; `res` is filled.
            unsafe { mlx_sys::mlx_distributed_all_sum(res, x, g, s) }
        })
    }

    /// Every rank's `x` concatenated along the first axis, in rank order.
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        self.collective("all_gather", x, |res, x, g, s| {
            // SAFETY: valid handles; `res` is filled.
            unsafe { mlx_sys::mlx_distributed_all_gather(res, x, g, s) }
        })
    }

    /// The element-wise maximum of `x` over every rank.
    pub fn all_max(&self, x: &Array) -> Result<Array> {
        self.collective("all_max", x, |res, x, g, s| {
            // SAFETY: valid handles; `res` is filled.
            unsafe { mlx_sys::mlx_distributed_all_max(res, x, g, s) }
        })
    }

    /// Sends `x` to rank `dst`; the send happens when the returned array is
    /// evaluated.
    pub fn send(&self, x: &Array, dst: usize) -> Result<Array> {
        let dst_i = self.peer(dst)?;
        self.collective("send", x, |res, x, g, s| {
            // SAFETY: valid handles; `res` is filled.
            unsafe { mlx_sys::mlx_distributed_send(res, x, dst_i, g, s) }
        })
    }

    /// Receives an array of `shape` and `dtype` from rank `src`.
    pub fn recv(&self, shape: &[i32], dtype: Dtype, src: usize) -> Result<Array> {
        let src_i = self.peer(src)?;
        let Some(raw) = &self.raw else {
            // `peer` accepts no rank of the one-rank group.
            return Err(DistributedError::Peer {
                rank: self.rank,
                peer: src,
                size: self.size,
            });
        };
        let stream = StreamOrDevice::default();
        self.made("recv", |res| {
            // SAFETY: `shape` lives across the call; handles are valid.
            unsafe {
                mlx_sys::mlx_distributed_recv(
                    res,
                    shape.as_ptr(),
                    shape.len(),
                    dtype.into(),
                    src_i,
                    raw.0,
                    stream.as_ref().as_ptr(),
                )
            }
        })
    }

    /// Receives from rank `src` an array shaped and typed as `like`.
    pub fn recv_like(&self, like: &Array, src: usize) -> Result<Array> {
        let src_i = self.peer(src)?;
        self.collective("recv", like, |res, x, g, s| {
            // SAFETY: valid handles; `res` is filled.
            unsafe { mlx_sys::mlx_distributed_recv_like(res, x, src_i, g, s) }
        })
    }

    fn peer(&self, peer: usize) -> Result<i32> {
        if peer >= self.size || peer == self.rank {
            return Err(DistributedError::Peer {
                rank: self.rank,
                peer,
                size: self.size,
            });
        }
        Ok(i32::try_from(peer).unwrap_or(i32::MAX))
    }

    fn collective(
        &self,
        operation: &'static str,
        x: &Array,
        op: impl FnOnce(
            *mut mlx_sys::mlx_array,
            mlx_sys::mlx_array,
            mlx_sys::mlx_distributed_group,
            mlx_sys::mlx_stream,
        ) -> i32,
    ) -> Result<Array> {
        let Some(raw) = &self.raw else {
            // MLX itself returns the input of a one-rank collective.
            return Ok(x.clone());
        };
        let stream = StreamOrDevice::default();
        self.made(operation, |res| {
            op(res, x.as_ptr(), raw.0, stream.as_ref().as_ptr())
        })
    }

    fn made(
        &self,
        operation: &'static str,
        op: impl FnOnce(*mut mlx_sys::mlx_array) -> i32,
    ) -> Result<Array> {
        // SAFETY: a fresh empty array handle for `op` to fill.
        let mut res = unsafe { mlx_sys::mlx_array_new() };
        match ffi::checked(|| op(&mut res)) {
            // SAFETY: filled by a successful call; owned from here on.
            Ok(()) => Ok(unsafe { Array::from_ptr(res) }),
            Err(message) => {
                // SAFETY: the handle is ours and freed once.
                unsafe { mlx_sys::mlx_array_free(res) };
                Err(self.refused(operation, message))
            }
        }
    }

    fn refused(&self, operation: &'static str, message: String) -> DistributedError {
        DistributedError::Operation {
            rank: self.rank,
            operation,
            message,
        }
    }
}

/// Sets an environment variable MLX reads, unless it already holds `value`.
fn set_env_if_different(name: &str, value: &str) {
    if std::env::var(name).ok().as_deref() != Some(value) {
        std::env::set_var(name, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_group_returns_its_input_and_has_no_peer() {
        let g = Group::single();
        let x = Array::from_slice(&[1.0f32, -2.0], &[2]);
        assert_eq!(g.all_gather(&x).unwrap().as_slice::<f32>(), &[1.0, -2.0]);
        assert!(matches!(
            g.send(&x, 0),
            Err(DistributedError::Peer {
                rank: 0,
                peer: 0,
                size: 1
            })
        ));
        assert!(matches!(
            g.recv(&[2], Dtype::Float32, 1),
            Err(DistributedError::Peer { .. })
        ));
    }

    #[test]
    fn a_rank_beyond_the_hostfile_is_refused_before_mlx_is_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts.json");
        Hostfile::loopback(2, 40100).unwrap().write(&path).unwrap();
        let err = Group::init(&GroupConfig::explicit(2, &path)).unwrap_err();
        assert!(
            matches!(err, DistributedError::RankOutOfRange { rank: 2, size: 2 }),
            "{err}"
        );
        let missing = Group::init(&GroupConfig::explicit(0, dir.path().join("none.json")));
        assert!(matches!(missing, Err(DistributedError::Hostfile { .. })));
    }
}
