//! The project's CPU products for a decode step's few rows, MLX-free:
//! slices in, slices out, every `unsafe` of them inside this crate.
//!
//! A decode step multiplies every weight by one row per conversation. BLAS
//! packs each weight before multiplying it, which for so few rows costs as
//! much as the product, and a weight in MLX's 4-bit packing would first be
//! unpacked to eight times its bytes. These kernels read each weight once,
//! front to back, as it is held:
//!
//! - [`panels::multiply`]: a dense f32 weight held in panels `(outputs /
//!   PANEL, inputs, PANEL)`, each panel the next [`PANEL`] outputs for
//!   every input, contiguous.
//! - [`packed::multiply`] and [`packed::routed`]: a weight (or a stack of
//!   experts) in MLX's 4-bit packing, its words unpacked in registers as
//!   `scale · q + bias`.
//!
//! Each output is summed in the inputs' order with fused multiply-adds,
//! whatever the rows around it or the threads: a row's result is the same
//! bits alone or in a batch, and equals the scalar loop
//! `acc = x.mul_add(w, acc)` over the inputs (the tests hold it to that).
//! It is not BLAS's order, so it differs from a BLAS product by rounding.
//!
//! The work is shared out over a [`Pool`] the caller owns; [`Workers`] says
//! how many of its threads one product may use.
//!
//! # Errors
//! [`Error::Unsupported`] where the CPU has neither AVX-512F nor AVX2 with
//! FMA (every machine but x86-64 ones, Apple Silicon included; [`Isa`]
//! names what runs); [`Error::Shape`] when the
//! slices do not fit the dimensions given. Nothing panics on bad input.
//!
//! # Example
//! ```
//! use cpu_kernels::{panels, Pool, PANEL};
//!
//! let pool = Pool::new(2)?;
//! let (rows, inputs) = (1, 2);
//! let x = [1.0f32, 2.0];
//! let w = vec![0.25f32; inputs * PANEL];
//! let mut y = vec![0.0f32; rows * PANEL];
//! match panels::multiply(&x, rows, inputs, &w, &mut y, pool.workers(2)) {
//!     Ok(()) => assert_eq!(y, vec![0.75; PANEL]),
//!     Err(cpu_kernels::Error::Unsupported) => {} // not x86-64 with AVX2 or AVX-512F
//!     Err(e) => return Err(e.into()),
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod isa;
pub mod packed;
pub mod panels;
mod pool;
mod tiles;

pub use error::{Error, Result};
pub use isa::Isa;
pub use pool::{Pool, Workers};
pub use tiles::{PANEL, TILE_ROWS};

/// Whether this CPU runs the kernels (x86-64 with AVX-512F, or AVX2 and
/// FMA): [`Isa::best`] names which.
pub fn supported() -> bool {
    Isa::best().is_some()
}
