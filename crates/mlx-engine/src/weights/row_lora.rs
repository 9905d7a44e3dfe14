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
//! Per layer, the rows of each adapter are gathered (one `take` each), their
//! low-rank products run on those rows alone, and the deltas are put back
//! in row order; rows of no adapter keep the base product's bits (a
//! `where`, not an added zero).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Mutex, PoisonError};

use mlx_rs::ops::indexing::{IndexOp, TryIndexOp};
use mlx_rs::ops::{concatenate, select, zeros_dtype};
use mlx_rs::Array;

use crate::error::{Error, Result};
use crate::weights::linear::{Linear, LinearProduct};

/// One adapter of the engine's, loaded: its name, scale and pairs.
struct NamedAdapter {
    name: String,
    dir: PathBuf,
    scale: f32,
    /// Module path (as the checkpoint names it) → `lora_a` `(in, rank)`,
    /// `lora_b` `(rank, out)`.
    pairs: BTreeMap<String, (Array, Array)>,
}

/// The adapters an engine serves by name, and which one each row of the
/// forward being built uses.
pub(crate) struct RowAdapters {
    adapters: Vec<NamedAdapter>,
    /// The adapted modules a linear layer was built for: what the load
    /// checks every pair against.
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

impl RowAdapters {
    /// Opens each `(name, folder)` (mlx_lm's `adapter_config.json` and
    /// `adapters.safetensors`) and copies its pairs into memory: they are
    /// small beside the base, and every forward of a row of theirs reads
    /// them.
    pub(crate) fn open(named: &[(String, PathBuf)]) -> Result<RowAdapters> {
        let mut adapters = Vec::with_capacity(named.len());
        for (name, dir) in named {
            if adapters.iter().any(|a: &NamedAdapter| &a.name == name) {
                return Err(adapter_error(name, dir, "two adapters have this name"));
            }
            let stream_err = |source| Error::Stream {
                dir: dir.clone(),
                source: Box::new(source),
            };
            let adapter = block_stream::MlxLmAdapter::open(dir).map_err(stream_err)?;
            let file = adapter.file();
            let mut pairs = BTreeMap::new();
            for (module, (a_key, b_key)) in adapter.pairs() {
                let load = |key: &str| -> Result<Array> {
                    let t = file.tensor(key).expect("a key of the file's own header");
                    Ok(mlx_support::array_from_bytes(
                        key, t.dtype, t.shape, t.data,
                    )?)
                };
                pairs.insert(module.clone(), (load(a_key)?, load(b_key)?));
            }
            adapters.push(NamedAdapter {
                name: name.clone(),
                dir: dir.clone(),
                scale: adapter.scale(),
                pairs,
            });
        }
        Ok(RowAdapters {
            used: Mutex::new(BTreeSet::new()),
            adapters,
        })
    }

    /// The slot of the adapter called `name`.
    pub(crate) fn slot(&self, name: &str) -> Option<usize> {
        self.adapters.iter().position(|a| a.name == name)
    }

    /// `base` with the adapters' pairs for `module` applied per row, or
    /// `base` itself when no adapter adapts it. A pair whose shapes do not
    /// fit the layer is [`Error::Adapter`] naming the key.
    pub(crate) fn wrap(&self, module: &str, inputs: usize, base: Linear) -> Result<Linear> {
        let outputs = base.outputs();
        let mut pairs = Vec::with_capacity(self.adapters.len());
        let mut any = false;
        for adapter in &self.adapters {
            let Some((a, b)) = adapter.pairs.get(module) else {
                pairs.push(None);
                continue;
            };
            let rank = a.shape().get(1).copied().unwrap_or(-1);
            let fits = a.shape() == [inputs as i32, rank] && b.shape() == [rank, outputs as i32];
            if !fits {
                return Err(adapter_error(
                    &adapter.name,
                    &adapter.dir,
                    &format!(
                        "{module}.lora_a {:?} and .lora_b {:?} do not fit a layer from {inputs} to {outputs}",
                        a.shape(),
                        b.shape()
                    ),
                ));
            }
            self.used
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(module.to_owned());
            pairs.push(Some(Pair {
                a: a.clone(),
                b: b.clone(),
                scale: adapter.scale,
            }));
            any = true;
        }
        if !any {
            return Ok(base);
        }
        Ok(Box::new(RowLora { base, pairs }))
    }

    /// After a load that built every layer: each pair's module must have
    /// been a linear layer of the model; the first that was not is
    /// [`Error::Adapter`] (an adapter never silently does nothing).
    pub(crate) fn check_all_used(&self) -> Result<()> {
        let used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
        self.check_modules(|module| used.contains(module))
    }

    /// Each pair's module passes `fits`; the first that does not is
    /// [`Error::Adapter`].
    pub(crate) fn check_modules(&self, mut fits: impl FnMut(&str) -> bool) -> Result<()> {
        for adapter in &self.adapters {
            if let Some(module) = adapter.pairs.keys().find(|m| !fits(m)) {
                return Err(adapter_error(
                    &adapter.name,
                    &adapter.dir,
                    &format!("{module}.lora_a adapts no linear layer of the model"),
                ));
            }
        }
        Ok(())
    }

    /// Runs `build` (a forward's graph) with row `i` under adapter
    /// `rows[i]` (a slot, or none).
    pub(crate) fn with_rows<T>(
        &self,
        rows: &[Option<usize>],
        build: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let plan = RowPlan::per_row(rows, self.adapters.len())?;
        with_plan(plan, build)
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

/// The rows of one forward by adapter, as the layers gather and put back
/// their deltas.
#[derive(Debug)]
pub(crate) struct Rows {
    rows: usize,
    /// Per adapter in use: its slot and its rows, ascending.
    groups: Vec<(usize, Array, i32)>,
    /// Rows of no adapter.
    plain: i32,
    /// Row `i`'s place in the gathered order (groups, then plain rows).
    back: Array,
    /// Whether row `i` has an adapter.
    adapted: Array,
}

impl RowPlan {
    /// `None` when no row has an adapter: the layers then run the base
    /// product alone.
    fn per_row(rows: &[Option<usize>], slots: usize) -> Result<Option<RowPlan>> {
        if rows.iter().all(Option::is_none) {
            return Ok(None);
        }
        if let Some(&Some(slot)) = rows.iter().find(|r| r.is_some_and(|s| s >= slots)) {
            return Err(no_slot(slot, slots));
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
        let adapted: Vec<bool> = rows.iter().map(Option::is_some).collect();
        Ok(Some(RowPlan::PerRow(Rows {
            rows: rows.len(),
            groups,
            plain: plain.len() as i32,
            back: Array::from_slice(&back, &[rows.len() as i32]),
            adapted: Array::from_slice(&adapted, &[rows.len() as i32]),
        })))
    }
}

/// One adapter's pair for one layer.
struct Pair {
    a: Array,
    b: Array,
    scale: f32,
}

impl Pair {
    /// mlx_lm's delta `(s · (x·A)·B)` cast to `x`'s dtype, with `a` and `b`
    /// the parts of the pair a product takes.
    fn delta(&self, x: &Array, a: &Array, b: &Array) -> Result<Array> {
        let z = x.matmul(a)?.matmul(b)?;
        let scale = Array::from_f32(self.scale).as_dtype(z.dtype())?;
        Ok(z.multiply(&scale)?.as_dtype(x.dtype())?)
    }
}

/// A linear layer with per-row adapters (see the module's docs).
struct RowLora {
    base: Linear,
    /// Per adapter slot: its pair for this layer, if it adapts it.
    pairs: Vec<Option<Pair>>,
}

impl RowLora {
    /// `y` (the base product of `x`) with each adapted row's delta added;
    /// `part` takes the pair's matrices a product uses.
    fn add_deltas(
        &self,
        x: &Array,
        y: Array,
        part: impl Fn(&Pair) -> Result<(Array, Array)>,
    ) -> Result<Array> {
        let current = current_plan();
        let plan = match current.as_deref() {
            None => return Ok(y),
            Some(RowPlan::Uniform(slot)) => {
                return match &self.pairs[*slot] {
                    Some(pair) => {
                        let (a, b) = part(pair)?;
                        Ok(y.add(&pair.delta(x, &a, &b)?)?)
                    }
                    None => Ok(y),
                }
            }
            Some(RowPlan::PerRow(rows)) => rows,
        };
        if x.dim(0) as usize != plan.rows {
            return Err(Error::Adapter {
                name: "(any)".to_owned(),
                dir: PathBuf::new(),
                message: format!(
                    "a forward of {} rows under a choice of adapters for {}",
                    x.dim(0),
                    plan.rows
                ),
            });
        }
        let tail: Vec<i32> = y.shape()[1..].to_vec();
        let zeros = |n: i32| -> Result<Array> {
            let shape: Vec<i32> = std::iter::once(n).chain(tail.iter().copied()).collect();
            Ok(zeros_dtype(&shape, y.dtype())?)
        };
        let mut parts = Vec::with_capacity(plan.groups.len() + 1);
        let mut any = false;
        for (slot, members, n) in &plan.groups {
            match &self.pairs[*slot] {
                Some(pair) => {
                    let (a, b) = part(pair)?;
                    parts.push(pair.delta(&x.take_axis(members, 0)?, &a, &b)?);
                    any = true;
                }
                None => parts.push(zeros(*n)?),
            }
        }
        if !any {
            return Ok(y);
        }
        if plan.plain > 0 {
            parts.push(zeros(plan.plain)?);
        }
        let delta = concatenate(&parts, 0)?.take_axis(&plan.back, 0)?;
        let mask_shape: Vec<i32> = std::iter::once(plan.rows as i32)
            .chain(tail.iter().map(|_| 1))
            .collect();
        let adapted = plan.adapted.reshape(&mask_shape)?;
        Ok(select(&adapted, &y.add(&delta)?, &y)?)
    }
}

impl LinearProduct for RowLora {
    fn forward(&self, x: &Array) -> Result<Array> {
        let y = self.base.forward(x)?;
        self.add_deltas(x, y, |p| Ok((p.a.clone(), p.b.clone())))
    }

    fn forward_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array> {
        let y = self.base.forward_outputs(x, outputs.clone())?;
        let cols = outputs.start as i32..outputs.end as i32;
        self.add_deltas(x, y, |p| {
            Ok((p.a.clone(), p.b.try_index((.., cols.clone()))?))
        })
    }

    /// The delta's part over `columns` too: `(x_c · A_c) · B` summed over
    /// the parts is the whole delta.
    fn forward_columns(&self, x: &Array, columns: Range<usize>) -> Result<Array> {
        let y = self.base.forward_columns(x, columns.clone())?;
        let rows = columns.start as i32..columns.end as i32;
        self.add_deltas(x, y, |p| Ok((p.a.index(rows.clone()), p.b.clone())))
    }

    fn outputs(&self) -> usize {
        self.base.outputs()
    }

    // `slice_group` stays `None`: a gated MLP takes adapted products whole.
}
