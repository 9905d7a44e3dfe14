//! Where the engine computes MLX's lazy graph before a result is asked
//! for. Every forced evaluation in the library goes through [`evaluate`]
//! with its reason, and `tests/tidy.rs` holds it so: a new evaluation
//! point is a new call here, named, not an `eval()` in passing.
//!
//! MLX records operations and computes them when values are needed. Left
//! alone, a whole forward would be one graph, computed when its logits are
//! read, with every intermediate alive at once. The engine cuts the graph
//! at these points, and only these ([`Why`]):
//!
//! - **Step**: generation's schedule. A decoding step is computed once,
//!   where its next tokens are read; the prefix cache once, before chunks
//!   share it.
//! - **Piece**: a product too big to hold whole (an MLP in column slices, a
//!   matrix in row slices, rows in groups, experts in groups) is computed a
//!   piece at a time, each piece before the next is built, so that one
//!   piece's intermediates are alive at once. This bounds the peak memory
//!   of the mapped and streamed modes.
//! - **Layer**: a streamed layer's outputs, computed before its weights are
//!   dropped and the next layer's are read.
//! - **Host**: values the host reads to decide what to compute next (the
//!   routing's choices, token ids).
//! - **Load**: weights made at load (laid out, unpacked), computed on the
//!   loading thread: lanes read the model's arrays from other threads and
//!   never compute a shared one.
//! - **Collective**: a distributed exchange, computed where it is issued,
//!   so that every rank meets its peers' sends and receives in one order.
//! - **Kernel**: the inputs of a product the project's CPU kernels
//!   (`cpu-kernels`) compute, read on the host.
//!
//! Reading an array's elements on the host computes it too, so host reads
//! go through here as well ([`host_slice`]), named like the rest.

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// Why an evaluation happens where it does (see the module's docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    Step,
    Piece,
    Layer,
    Host,
    Load,
    Collective,
    Kernel,
}

/// Computes `arrays` now, for `why`.
pub(crate) fn evaluate<'a>(
    why: Why,
    arrays: impl IntoIterator<Item = &'a Array>,
) -> Result<(), Exception> {
    tracing::trace!(?why, "evaluate");
    mlx_rs::transforms::eval(arrays)
}

/// Computes `a` for `why` and lends its elements, row-contiguous, to the
/// host. `what` names the array in the error when it cannot be read (a
/// dtype other than `T`, or not row-contiguous).
pub(crate) fn host_slice<'a, T: mlx_rs::ArrayElement>(
    why: Why,
    what: &'static str,
    a: &'a Array,
) -> crate::Result<&'a [T]> {
    evaluate(why, [a])?;
    a.try_as_slice::<T>().map_err(|e| crate::Error::HostRead {
        what,
        reason: e.to_string(),
    })
}
