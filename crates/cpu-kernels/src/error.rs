//! What a kernel call can refuse.

/// Why a kernel did not run. Nothing was written to its output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CPU lacks the instructions the kernels are written for.
    #[error("this CPU has neither AVX-512F nor AVX2 with FMA, one of which the kernels need")]
    Unsupported,
    /// A slice or dimension does not fit the others.
    #[error("{what}: expected {expected}, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A range of outputs or columns that does not fall on the kernel's
    /// edges (panels of outputs, whole quantization groups of columns).
    #[error("{what} {value} is not a multiple of {multiple}")]
    Unaligned {
        what: &'static str,
        value: usize,
        multiple: usize,
    },
    /// A range that reaches past the matrix (or an expert past the stack).
    #[error("{what} {end} is past the matrix's {limit}")]
    OutOfRange {
        what: &'static str,
        end: usize,
        limit: usize,
    },
    /// The pool's threads could not be started.
    #[error("starting the kernels' threads: {0}")]
    Pool(#[from] rayon::ThreadPoolBuildError),
}

/// A kernel call's result.
pub type Result<T> = std::result::Result<T, Error>;

/// [`Error::Shape`] unless `actual == expected`.
pub(crate) fn expect(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(Error::Shape {
            what,
            expected,
            actual,
        })
    }
}

/// [`Error::Unaligned`] unless `value` is a multiple of `multiple`.
pub(crate) fn aligned(what: &'static str, value: usize, multiple: usize) -> Result<()> {
    if multiple > 0 && value.is_multiple_of(multiple) {
        Ok(())
    } else {
        Err(Error::Unaligned {
            what,
            value,
            multiple,
        })
    }
}

/// [`Error::OutOfRange`] unless `end <= limit`.
pub(crate) fn within(what: &'static str, end: usize, limit: usize) -> Result<()> {
    if end <= limit {
        Ok(())
    } else {
        Err(Error::OutOfRange { what, end, limit })
    }
}
