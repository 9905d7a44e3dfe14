//! Adapters kept beside the base weights, unfused, and applied per row:
//! `y = x·Wᵀ + b + s·(x·A)·B` with each row's own `A`, `B` and scale
//! (mlx_lm's `LoRALinear`: the low-rank product in the adapter's dtype,
//! scaled, cast to `x`'s dtype, added). The base weights are never copied
//! per adapter, so rows of several adapters (and rows of none) decode in
//! one batch over one copy of the model.
//!
//! Which adapter each row of a forward uses is not an argument of every
//! layer's product: the runtime sets a [`RowPlan`] around the building of
//! a forward's graph (`Model::with_adapters`, `Model::with_adapter`), and
//! every adapted layer reads it. The plan is the building thread's own: a
//! forward's graph is built on one thread, and lanes build theirs side by
//! side, each under its own plan.
//!
//! Each module's pairs are held stacked over the adapters (`(K, in, r)`,
//! `(K, r, out)`, zeros where an adapter has a lower rank or does not adapt
//! the module). A forward whose rows all use one adapter multiplies by its
//! pair alone, cut to its rank. A forward whose rows use several runs one
//! of two [`Strategy`]s: one gather of each row's pair and one batched
//! product for all rows, or one gather of each adapter's rows and one
//! product per adapter; the bench measures both (docs/benchmarks.md). Rows
//! of no adapter keep the base product's bits (a `where`, not an added
//! zero).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Mutex, PoisonError};

use mlx_rs::ops::indexing::{IndexOp, TryIndexOp};
use mlx_rs::ops::{concatenate, expand_dims_axes, select, zeros_dtype};
use mlx_rs::Array;

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, Why};
use crate::weights::linear::{Linear, LinearProduct};

/// One adapter of the engine's: its name, folder and scale.
struct NamedAdapter {
    name: String,
    dir: PathBuf,
    scale: f32,
}

/// One module's pairs over the adapters, stacked (see the module's docs).
#[derive(Clone)]
struct Stacked {
    /// `lora_a` of every adapter, `(K, in, r)`.
    a: Array,
    /// `lora_b` of every adapter, `(K, r, out)`.
    b: Array,
    /// Each adapter's rank; 0 where it does not adapt the module.
    ranks: Vec<usize>,
    /// Each adapter's scale.
    scales: Vec<f32>,
}

/// How a forward whose rows use several adapters computes their deltas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// Each row's pair gathered from the stacks; one batched product.
    Gather,
    /// Each adapter's rows gathered; one product per adapter, the deltas
    /// put back in row order.
    Segments,
}

impl Strategy {
    /// The environment variable that picks one (for measurements).
    pub(crate) const ENV: &'static str = "MLX_LOWMEM_ROW_LORA";

    /// `MLX_LOWMEM_ROW_LORA`: `gather` or `segments`; unset (or empty):
    /// gather.
    fn from_env() -> Result<Strategy> {
        match std::env::var(Strategy::ENV).unwrap_or_default().as_str() {
            "" | "gather" => Ok(Strategy::Gather),
            "segments" => Ok(Strategy::Segments),
            other => Err(Error::Setting {
                name: Strategy::ENV,
                value: other.to_owned(),
                expected: "gather or segments",
            }),
        }
    }
}

/// The adapters an engine serves by name, and which one each row of the
/// forward being built uses.
pub(crate) struct RowAdapters {
    adapters: Vec<NamedAdapter>,
    strategy: Strategy,
    /// Module path (as the checkpoint names it) → its pairs, stacked.
    modules: BTreeMap<String, Stacked>,
    /// The adapted modules a linear layer was built for: what the load
    /// checks every module against.
    used: Mutex<BTreeSet<String>>,
}

impl std::fmt::Debug for RowAdapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.adapters.iter().map(|a| a.name.as_str()).collect();
        f.debug_struct("RowAdapters")
            .field("names", &names)
            .finish_non_exhaustive()
    }
}

/// An adapter's pair for `module`, copied out of its file: `lora_a`
/// `(in, r)`, `lora_b` `(r, out)`; `None` where it does not adapt it.
fn pair_of(adapter: &block_stream::MlxLmAdapter, module: &str) -> Result<Option<(Array, Array)>> {
    let Some((a_key, b_key)) = adapter.pairs().get(module) else {
        return Ok(None);
    };
    let load = |key: &str| -> Result<Array> {
        let t = adapter
            .file()
            .tensor(key)
            .expect("a key of the file's own header");
        Ok(mlx_support::array_from_bytes(
            key, t.dtype, t.shape, t.data,
        )?)
    };
    Ok(Some((load(a_key)?, load(b_key)?)))
}

impl RowAdapters {
    /// Opens each `(name, folder)` (mlx_lm's `adapter_config.json` and
    /// `adapters.safetensors`) and stacks its pairs into memory, module by
    /// module: they are small beside the base, and every forward of a row
    /// of theirs reads them. An adapter whose pair for a module has other
    /// inputs or outputs than another adapter's for the same module is
    /// [`Error::Adapter`].
    pub(crate) fn open(named: &[(String, PathBuf)]) -> Result<RowAdapters> {
        let mut adapters = Vec::with_capacity(named.len());
        let mut files = Vec::with_capacity(named.len());
        for (name, dir) in named {
            if adapters.iter().any(|a: &NamedAdapter| &a.name == name) {
                return Err(adapter_error(name, dir, "two adapters have this name"));
            }
            let adapter =
                block_stream::MlxLmAdapter::open(dir).map_err(|source| Error::Stream {
                    dir: dir.clone(),
                    source: Box::new(source),
                })?;
            adapters.push(NamedAdapter {
                name: name.clone(),
                dir: dir.clone(),
                scale: adapter.scale(),
            });
            files.push(adapter);
        }
        // A module at a time, so that the load holds the stacks and one
        // module's pairs, not every pair twice.
        let names: BTreeSet<&String> = files.iter().flat_map(|f| f.pairs().keys()).collect();
        let mut modules = BTreeMap::new();
        for module in names {
            let pairs = files
                .iter()
                .map(|f| pair_of(f, module))
                .collect::<Result<Vec<_>>>()?;
            let stacked = stack(&adapters, &pairs, module)?;
            evaluate(Why::Load, [&stacked.a, &stacked.b])?;
            modules.insert(module.clone(), stacked);
        }
        Ok(RowAdapters {
            adapters,
            strategy: Strategy::from_env()?,
            modules,
            used: Mutex::new(BTreeSet::new()),
        })
    }

    /// The slot of the adapter called `name`.
    pub(crate) fn slot(&self, name: &str) -> Option<usize> {
        self.adapters.iter().position(|a| a.name == name)
    }

    /// `base` with the adapters' pairs for `module` applied per row, or
    /// `base` itself when no adapter adapts it. Pairs whose shapes do not
    /// fit the layer are [`Error::Adapter`] naming the first adapter and
    /// the key.
    pub(crate) fn wrap(&self, module: &str, inputs: usize, base: Linear) -> Result<Linear> {
        let Some(stacked) = self.modules.get(module) else {
            return Ok(base);
        };
        let outputs = base.outputs();
        let (a, b) = (stacked.a.shape(), stacked.b.shape());
        if a[1] as usize != inputs || b[2] as usize != outputs {
            let first = stacked.ranks.iter().position(|&r| r > 0).unwrap_or(0);
            let adapter = &self.adapters[first];
            return Err(adapter_error(
                &adapter.name,
                &adapter.dir,
                &format!(
                    "{module}.lora_a and .lora_b take {} inputs to {} outputs, the layer {inputs} to {outputs}",
                    a[1], b[2]
                ),
            ));
        }
        self.used
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(module.to_owned());
        Ok(Box::new(RowLora {
            base,
            stacked: stacked.clone(),
            strategy: self.strategy,
        }))
    }

    /// Whether a linear layer was built for `module` (and its pairs are
    /// applied there).
    pub(crate) fn was_built(&self, module: &str) -> bool {
        self.used
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(module)
    }

    /// Each pair's module passes `fits`; the first that does not is
    /// [`Error::Adapter`].
    pub(crate) fn check_modules(&self, mut fits: impl FnMut(&str) -> bool) -> Result<()> {
        let Some((module, stacked)) = self.modules.iter().find(|(m, _)| !fits(m)) else {
            return Ok(());
        };
        let first = stacked.ranks.iter().position(|&r| r > 0).unwrap_or(0);
        let adapter = &self.adapters[first];
        Err(adapter_error(
            &adapter.name,
            &adapter.dir,
            &format!("{module}.lora_a adapts no linear layer of the model"),
        ))
    }

    /// Runs `build` (a forward's graph) with row `i` under adapter
    /// `rows[i]` (a slot, or none).
    pub(crate) fn with_rows<T>(
        &self,
        rows: &[Option<usize>],
        build: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let scales: Vec<f32> = self.adapters.iter().map(|a| a.scale).collect();
        with_plan(RowPlan::per_row(rows, &scales)?, build)
    }

    /// Runs `build` with every row of its forwards, whatever their number,
    /// under the adapter in `slot`.
    pub(crate) fn with_slot<T>(&self, slot: usize, build: impl FnOnce() -> Result<T>) -> Result<T> {
        self.check_slot(slot)?;
        with_plan(Some(RowPlan::Uniform(slot)), build)
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        match slot < self.adapters.len() {
            true => Ok(()),
            false => Err(no_slot(slot, self.adapters.len())),
        }
    }
}

thread_local! {
    /// The plan of the forward this thread is building (see the module's
    /// docs).
    static PLAN: RefCell<Option<Rc<RowPlan>>> = const { RefCell::new(None) };
}

/// Runs `build` under `plan`, then puts back the plan that was set.
fn with_plan<T>(plan: Option<RowPlan>, build: impl FnOnce() -> Result<T>) -> Result<T> {
    let before = PLAN.with(|p| p.replace(plan.map(Rc::new)));
    let out = build();
    PLAN.with(|p| p.replace(before));
    out
}

fn current_plan() -> Option<Rc<RowPlan>> {
    PLAN.with(|p| p.borrow().clone())
}

/// A slot past the `slots` adapters served (a fault of the runtime's).
fn no_slot(slot: usize, slots: usize) -> Error {
    Error::Adapter {
        name: format!("slot {slot}"),
        dir: PathBuf::new(),
        message: format!("the engine serves {slots} adapters"),
    }
}

fn adapter_error(name: &str, dir: &Path, message: &str) -> Error {
    Error::Adapter {
        name: name.to_owned(),
        dir: dir.to_path_buf(),
        message: message.to_owned(),
    }
}

/// Which adapter the rows of a forward use.
#[derive(Debug)]
pub(crate) enum RowPlan {
    /// Every row, whatever their number, the adapter in this slot.
    Uniform(usize),
    /// Each row its own (see [`Rows`]).
    PerRow(Rows),
}

/// The rows of one forward by adapter, as the layers gather their pairs
/// (or their rows, by adapter).
#[derive(Debug)]
pub(crate) struct Rows {
    rows: usize,
    /// Per adapter in use: its slot and its rows, ascending.
    groups: Vec<(usize, Array, i32)>,
    /// Rows of no adapter.
    plain: i32,
    /// Row `i`'s place in the gathered order (groups, then plain rows).
    back: Array,
    /// Each row's adapter slot (0 for a row of none: masked out).
    slots: Array,
    /// Each row's adapter's scale (f32).
    scales: Array,
    /// Whether row `i` has an adapter.
    adapted: Array,
}

impl RowPlan {
    /// `None` when no row has an adapter: the layers then run the base
    /// product alone; [`RowPlan::Uniform`] when every row has the same.
    fn per_row(rows: &[Option<usize>], scales: &[f32]) -> Result<Option<RowPlan>> {
        let slots = scales.len();
        if let Some(&Some(slot)) = rows.iter().find(|r| r.is_some_and(|s| s >= slots)) {
            return Err(no_slot(slot, slots));
        }
        match rows.first() {
            None => return Ok(None),
            Some(&first) if rows.iter().all(|&r| r == first) => {
                return Ok(first.map(RowPlan::Uniform))
            }
            Some(_) => {}
        }
        let mut order: Vec<usize> = Vec::with_capacity(rows.len());
        let mut groups = Vec::new();
        for slot in 0..slots {
            let members: Vec<i32> = (0..rows.len())
                .filter(|&i| rows[i] == Some(slot))
                .map(|i| i as i32)
                .collect();
            if members.is_empty() {
                continue;
            }
            order.extend(members.iter().map(|&i| i as usize));
            let n = members.len() as i32;
            groups.push((slot, Array::from_slice(&members, &[n]), n));
        }
        let plain: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].is_none()).collect();
        order.extend(&plain);
        let mut back = vec![0i32; rows.len()];
        for (place, &row) in order.iter().enumerate() {
            back[row] = place as i32;
        }
        let n = rows.len() as i32;
        let slot_of: Vec<i32> = rows.iter().map(|r| r.unwrap_or(0) as i32).collect();
        let scale_of: Vec<f32> = rows.iter().map(|r| r.map_or(0.0, |s| scales[s])).collect();
        let adapted: Vec<bool> = rows.iter().map(Option::is_some).collect();
        Ok(Some(RowPlan::PerRow(Rows {
            rows: rows.len(),
            groups,
            plain: plain.len() as i32,
            back: Array::from_slice(&back, &[n]),
            slots: Array::from_slice(&slot_of, &[n]),
            scales: Array::from_slice(&scale_of, &[n]),
            adapted: Array::from_slice(&adapted, &[n]),
        })))
    }
}

/// `module`'s pairs over `adapters` (`pairs[k]` adapter `k`'s), stacked,
/// ranks padded with zeros; in the dtype they share, or f32.
fn stack(
    adapters: &[NamedAdapter],
    pairs: &[Option<(Array, Array)>],
    module: &str,
) -> Result<Stacked> {
    let present: Vec<(usize, &(Array, Array))> = pairs
        .iter()
        .enumerate()
        .filter_map(|(k, pair)| pair.as_ref().map(|p| (k, p)))
        .collect();
    let (first, (a0, b0)) = present[0];
    let (inputs, outputs) = (a0.dim(0), b0.dim(1));
    let ranks: Vec<usize> = pairs
        .iter()
        .map(|pair| pair.as_ref().map_or(0, |(a, _)| a.dim(1) as usize))
        .collect();
    let rank = *ranks.iter().max().unwrap_or(&0) as i32;
    let same_dtype = present
        .iter()
        .all(|(_, (a, b))| a.dtype() == a0.dtype() && b.dtype() == a0.dtype());
    let dtype = if same_dtype {
        a0.dtype()
    } else {
        mlx_rs::Dtype::Float32
    };
    let mut a_parts = Vec::with_capacity(pairs.len());
    let mut b_parts = Vec::with_capacity(pairs.len());
    for (k, pair) in pairs.iter().enumerate() {
        let r = ranks[k] as i32;
        let (a, b) = match pair {
            Some((a, b)) => {
                let fits = a.shape() == [inputs, r] && b.shape() == [r, outputs];
                if !fits {
                    let (other, this) = (&adapters[first], &adapters[k]);
                    return Err(adapter_error(
                        &this.name,
                        &this.dir,
                        &format!(
                            "{module}.lora_a {:?} and .lora_b {:?} do not fit the layer adapter {:?} adapts ({inputs} to {outputs})",
                            a.shape(),
                            b.shape(),
                            other.name
                        ),
                    ));
                }
                (a.as_dtype(dtype)?, b.as_dtype(dtype)?)
            }
            None => (
                zeros_dtype(&[inputs, 0], dtype)?,
                zeros_dtype(&[0, outputs], dtype)?,
            ),
        };
        a_parts.push(concatenate(
            &[a, zeros_dtype(&[inputs, rank - r], dtype)?],
            1,
        )?);
        b_parts.push(concatenate(
            &[b, zeros_dtype(&[rank - r, outputs], dtype)?],
            0,
        )?);
    }
    Ok(Stacked {
        a: mlx_rs::ops::stack(&a_parts, 0)?,
        b: mlx_rs::ops::stack(&b_parts, 0)?,
        ranks,
        scales: adapters.iter().map(|a| a.scale).collect(),
    })
}

/// mlx_lm's delta `(s · (x·A)·B)` cast to `x`'s dtype, `scale` an array
/// that broadcasts over the product (one value, or one per row).
fn delta(x: &Array, a: &Array, b: &Array, scale: &Array) -> Result<Array> {
    let z = x.matmul(a)?.matmul(b)?;
    Ok(z.multiply(scale.as_dtype(z.dtype())?)?
        .as_dtype(x.dtype())?)
}

/// A linear layer with per-row adapters (see the module's docs).
struct RowLora {
    base: Linear,
    stacked: Stacked,
    strategy: Strategy,
}

impl RowLora {
    /// `y` (the base product of `x`) with each adapted row's delta added;
    /// `part` takes the stacked matrices' parts a product uses.
    fn add_deltas(
        &self,
        x: &Array,
        y: Array,
        part: impl Fn(&Array, &Array) -> Result<(Array, Array)>,
    ) -> Result<Array> {
        let current = current_plan();
        let rows = match current.as_deref() {
            None => return Ok(y),
            Some(&RowPlan::Uniform(slot)) => {
                let (a, b) = part(&self.stacked.a, &self.stacked.b)?;
                return match self.one_adapter(x, &a, &b, slot)? {
                    Some(delta) => Ok(y.add(delta)?),
                    None => Ok(y),
                };
            }
            Some(RowPlan::PerRow(rows)) => rows,
        };
        if x.dim(0) as usize != rows.rows {
            return Err(Error::Adapter {
                name: "(any)".to_owned(),
                dir: PathBuf::new(),
                message: format!(
                    "a forward of {} rows under a choice of adapters for {}",
                    x.dim(0),
                    rows.rows
                ),
            });
        }
        let (a, b) = part(&self.stacked.a, &self.stacked.b)?;
        if self.strategy == Strategy::Segments {
            return self.by_adapter(x, y, rows, &a, &b);
        }
        // Each row's pair, `(B, in, r)` and `(B, r, out)`, and the rows as
        // `(B, L, in)`: one batched product for every adapter at once.
        let (a, b) = (a.take_axis(&rows.slots, 0)?, b.take_axis(&rows.slots, 0)?);
        let flat = x.ndim() == 2;
        let x3 = if flat {
            expand_dims_axes(x, &[1])?
        } else {
            x.clone()
        };
        let n = rows.rows as i32;
        let scales = rows.scales.reshape(&[n, 1, 1])?;
        let mut z = delta(&x3, &a, &b, &scales)?;
        if flat {
            z = z.squeeze_axes(&[1])?;
        }
        let mask_shape: Vec<i32> = std::iter::once(n)
            .chain(std::iter::repeat_n(1, y.ndim() - 1))
            .collect();
        let adapted = rows.adapted.reshape(&mask_shape)?;
        Ok(select(&adapted, &y.add(&z)?, &y)?)
    }
}

impl RowLora {
    /// The delta of `x` under the adapter in `slot` (`a`, `b` the stacks'
    /// parts), `None` where it does not adapt this layer.
    fn one_adapter(&self, x: &Array, a: &Array, b: &Array, slot: usize) -> Result<Option<Array>> {
        let rank = self.stacked.ranks[slot] as i32;
        if rank == 0 {
            return Ok(None);
        }
        let a = a.index((slot as i32, .., ..rank));
        let b = b.index((slot as i32, ..rank, ..));
        let scale = Array::from_f32(self.stacked.scales[slot]);
        Ok(Some(delta(x, &a, &b, &scale)?))
    }

    /// [`Strategy::Segments`]: each adapter's rows gathered and multiplied
    /// by its pair; the deltas put back in row order.
    fn by_adapter(&self, x: &Array, y: Array, rows: &Rows, a: &Array, b: &Array) -> Result<Array> {
        let tail: Vec<i32> = y.shape()[1..].to_vec();
        let zeros = |n: i32| -> Result<Array> {
            let shape: Vec<i32> = std::iter::once(n).chain(tail.iter().copied()).collect();
            Ok(zeros_dtype(&shape, y.dtype())?)
        };
        let mut parts = Vec::with_capacity(rows.groups.len() + 1);
        for (slot, members, n) in &rows.groups {
            match self.one_adapter(&x.take_axis(members, 0)?, a, b, *slot)? {
                Some(delta) => parts.push(delta),
                None => parts.push(zeros(*n)?),
            }
        }
        if rows.plain > 0 {
            parts.push(zeros(rows.plain)?);
        }
        let delta = concatenate(&parts, 0)?.take_axis(&rows.back, 0)?;
        let mask_shape: Vec<i32> = std::iter::once(rows.rows as i32)
            .chain(tail.iter().map(|_| 1))
            .collect();
        let adapted = rows.adapted.reshape(&mask_shape)?;
        Ok(select(&adapted, &y.add(&delta)?, &y)?)
    }
}

impl LinearProduct for RowLora {
    fn forward(&self, x: &Array) -> Result<Array> {
        let y = self.base.forward(x)?;
        self.add_deltas(x, y, |a, b| Ok((a.clone(), b.clone())))
    }

    fn forward_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array> {
        let y = self.base.forward_outputs(x, outputs.clone())?;
        let cols = outputs.start as i32..outputs.end as i32;
        self.add_deltas(x, y, |a, b| {
            Ok((a.clone(), b.try_index((.., .., cols.clone()))?))
        })
    }

    /// The delta's part over `columns` too: `(x_c · A_c) · B` summed over
    /// the parts is the whole delta.
    fn forward_columns(&self, x: &Array, columns: Range<usize>) -> Result<Array> {
        let y = self.base.forward_columns(x, columns.clone())?;
        let rows = columns.start as i32..columns.end as i32;
        self.add_deltas(x, y, |a, b| {
            Ok((a.try_index((.., rows.clone(), ..))?, b.clone()))
        })
    }

    fn outputs(&self) -> usize {
        self.base.outputs()
    }

    // `slice_group` stays `None`: a gated MLP takes adapted products whole.
}
