//! Adapters kept beside the base weights, unfused, and applied per row:
//! `y = x·Wᵀ + b + s·(x·A)·B` with each row's own `A`, `B` and scale
//! (mlx_lm's `LoRALinear`: the low-rank product in the adapter's dtype,
//! scaled, cast to `x`'s dtype, added). The base weights are never copied
//! per adapter, so rows of several adapters (and rows of none) decode in
//! one batch over one copy of the model.
//!
//! Which adapter each row of a forward uses is not an argument of every
//! layer's product: the runtime sets a plan around the building of a
//! forward's graph (`Model::with_adapters`, `Model::with_adapter`), and
//! every linear layer reads it. The plan is the building thread's own: a
//! forward's graph is built on one thread, and lanes build theirs side by
//! side, each under its own plan.
//!
//! Adapters are loaded and unloaded while the engine serves. Every linear
//! layer of an engine's model is wrapped, so that an adapter loaded later
//! reaches the layers it adapts; a layer no adapter of the moment adapts
//! runs its base product alone, as unwrapped. The adapters served and
//! their pairs are one value ([`Served`]) replaced whole by a load or an
//! unload: a plan holds the one its forward was built under. Each adapter
//! has a slot, a number given at its load and never given again, so that
//! what the runtime keeps per adapter (prefix caches) can never be taken
//! for another adapter's.
//!
//! Each module's pairs are held stacked over the adapters (`stack.rs`). A
//! forward whose rows all use one adapter multiplies by its pair alone,
//! cut to its rank. A forward whose rows use several runs one of two
//! [`Strategy`]s: one gather of each row's pair and one batched product
//! for all rows, or one gather of each adapter's rows and one product per
//! adapter; the bench measures both (docs/benchmarks.md). Rows of no
//! adapter keep the base product's bits (a `where`, not an added zero).

mod product;
mod stack;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, Why};
use crate::weights::linear::Linear;
use product::{plan_rows, PlanRows, RowLora, RowPlan};
use stack::{pair_of, stack, Stacked};

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

/// An adapter to serve: its name, where it was given (`dir`, what errors
/// name), the mlx_lm folder its files are read from (`dir` itself, or the
/// codec's file decoded) and the names its config and weights go by in
/// errors; with a prefix folder, the digest of its files that a prefix
/// computed under it is bound to.
#[derive(Debug, Clone)]
pub(crate) struct AdapterSpec {
    pub name: String,
    pub dir: PathBuf,
    pub folder: PathBuf,
    pub shown: (PathBuf, PathBuf),
    pub digest: Option<String>,
}

/// One adapter served.
struct NamedAdapter {
    slot: usize,
    name: String,
    dir: PathBuf,
    scale: f32,
    digest: Option<String>,
}

/// The adapters served at one moment and their pairs, by module.
pub(crate) struct Served {
    /// In stacking order: the adapter at position `k` is the `k`th of
    /// every stack.
    adapters: Vec<NamedAdapter>,
    /// Module path (as the checkpoint names it) → its pairs, stacked.
    modules: BTreeMap<String, Stacked>,
}

impl Served {
    fn shared(adapters: Vec<NamedAdapter>, modules: BTreeMap<String, Stacked>) -> Arc<Served> {
        #[expect(
            clippy::arc_with_non_send_sync,
            reason = "read by the threads that build forwards, the worker and its lanes, as the model's own weights are (see ForLanes)"
        )]
        let served = Arc::new(Served { adapters, modules });
        served
    }

    fn position(&self, slot: usize) -> Option<usize> {
        self.adapters.iter().position(|a| a.slot == slot)
    }

    /// The first adapter (in stacking order) adapting `module`.
    fn first_adapting(&self, module: &str) -> &NamedAdapter {
        let ranks = &self.modules[module].ranks;
        &self.adapters[ranks.iter().position(|&r| r > 0).unwrap_or(0)]
    }
}

/// The linear layers an adapter may adapt.
#[derive(Default)]
struct Layers {
    /// Layers built so far: module → (inputs, outputs).
    built: BTreeMap<String, (usize, usize)>,
    /// Once the model is built, the modules of every matrix its decoder
    /// layers' files hold: built later (streamed) or never (the key and value
    /// projections a KV-shared Gemma 4 layer keeps unused, which an mlx_lm
    /// adapter may carry, as cc-sentiment's does: they change nothing
    /// there either).
    matrices: Option<BTreeSet<String>>,
}

impl Layers {
    /// Why `module`'s pair of `inputs` to `outputs` adapts no layer, if it
    /// does not. Before the model is built, every module fits: the load
    /// checks them once it is.
    fn misfit(&self, module: &str, inputs: usize, outputs: usize) -> Option<String> {
        if let Some(&(i, o)) = self.built.get(module) {
            return ((i, o) != (inputs, outputs)).then(|| {
                format!("{module}.lora_a and .lora_b take {inputs} inputs to {outputs} outputs, the layer {i} to {o}")
            });
        }
        let matrices = self.matrices.as_ref()?;
        (!matrices.contains(module))
            .then(|| format!("{module}.lora_a adapts no linear layer of the model"))
    }
}

/// The adapters an engine serves by name, and which one each row of the
/// forward being built uses.
pub(crate) struct RowAdapters {
    strategy: Strategy,
    /// Replaced whole by a load or an unload (see the module's docs).
    served: Mutex<Arc<Served>>,
    layers: Mutex<Layers>,
    next_slot: AtomicUsize,
}

impl std::fmt::Debug for RowAdapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowAdapters")
            .field("names", &self.names())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RowAdapters {
    /// Serving no adapter yet.
    pub(crate) fn new() -> Result<RowAdapters> {
        Ok(RowAdapters {
            strategy: Strategy::from_env()?,
            served: Mutex::new(Served::shared(Vec::new(), BTreeMap::new())),
            layers: Mutex::new(Layers::default()),
            next_slot: AtomicUsize::new(0),
        })
    }

    /// Opens each adapter of `specs` (mlx_lm's `adapter_config.json` and
    /// `adapters.safetensors`) and serves it beside those served already,
    /// its pairs copied into memory: they are small beside the base, and
    /// every forward of a row of theirs reads them. Returns their slots.
    ///
    /// Nothing changes unless every adapter fits: a name already served,
    /// a pair whose module is no linear layer of the model or whose shapes
    /// do not fit it or another adapter's pair for the module is
    /// [`Error::Adapter`] naming the adapter and the key.
    pub(crate) fn add(&self, specs: &[AdapterSpec]) -> Result<Vec<usize>> {
        let mut served = lock(&self.served);
        let mut adapters: Vec<NamedAdapter> = Vec::with_capacity(specs.len());
        let mut files = Vec::with_capacity(specs.len());
        for spec in specs {
            let taken = served.adapters.iter().chain(&adapters);
            if taken.into_iter().any(|a| a.name == spec.name) {
                return Err(adapter_error(
                    &spec.name,
                    &spec.dir,
                    "an adapter of this name is served already",
                ));
            }
            let (config, weights) = &spec.shown;
            let file = block_stream::MlxLmAdapter::open_named(&spec.folder, config, weights)
                .map_err(|source| Error::Stream {
                    dir: spec.dir.clone(),
                    source: Box::new(source),
                })?;
            self.check_fit(&spec.name, &spec.dir, &file)?;
            adapters.push(NamedAdapter {
                slot: usize::MAX,
                name: spec.name.clone(),
                dir: spec.dir.clone(),
                scale: file.scale(),
                digest: spec.digest.clone(),
            });
            files.push(file);
        }
        let old = served.adapters.len();
        let all: Vec<&NamedAdapter> = served.adapters.iter().chain(&adapters).collect();
        let modules: BTreeSet<&String> = served
            .modules
            .keys()
            .chain(files.iter().flat_map(|f| f.pairs().keys()))
            .collect();
        // A module at a time, so that the load holds the stacks and one
        // module's pairs, not every pair twice.
        let mut stacks = BTreeMap::new();
        for module in modules {
            let mut pairs = Vec::with_capacity(all.len());
            for k in 0..old {
                pairs.push(match served.modules.get(module) {
                    Some(stacked) => stacked.pair(k)?,
                    None => None,
                });
            }
            for file in &files {
                pairs.push(pair_of(file, module)?);
            }
            if let Some(stacked) = stack(&all, &pairs, module)? {
                evaluate(Why::Load, [&stacked.a, &stacked.b])?;
                stacks.insert(module.clone(), stacked);
            }
        }
        let slots: Vec<usize> = adapters
            .iter_mut()
            .map(|a| {
                a.slot = self.next_slot.fetch_add(1, Ordering::Relaxed);
                a.slot
            })
            .collect();
        let mut kept: Vec<NamedAdapter> = served.adapters.iter().map(NamedAdapter::copy).collect();
        kept.extend(adapters);
        *served = Served::shared(kept, stacks);
        Ok(slots)
    }

    /// `file`'s pairs each adapt a linear layer of the model, as far as it
    /// is known yet (see [`Layers::misfit`]).
    fn check_fit(&self, name: &str, dir: &Path, file: &block_stream::MlxLmAdapter) -> Result<()> {
        let layers = lock(&self.layers);
        for (module, (a_key, b_key)) in file.pairs() {
            let shape = |key: &str| file.file().tensor(key).map(|t| t.shape.to_vec());
            let (Some(a), Some(b)) = (shape(a_key), shape(b_key)) else {
                continue;
            };
            let why = match (a.as_slice(), b.as_slice()) {
                (&[inputs, _], &[_, outputs]) => layers.misfit(module, inputs, outputs),
                _ => Some(format!("{a_key} {a:?} and {b_key} {b:?} are not matrices")),
            };
            if let Some(why) = why {
                return Err(adapter_error(name, dir, &why));
            }
        }
        Ok(())
    }

    /// Stops serving the adapter called `name` (a forward built before
    /// goes on with the adapters of its plan); returns its slot, or `None`
    /// when no adapter is called so.
    pub(crate) fn remove(&self, name: &str) -> Result<Option<usize>> {
        let mut served = lock(&self.served);
        let Some(gone) = served.adapters.iter().position(|a| a.name == name) else {
            return Ok(None);
        };
        let kept: Vec<NamedAdapter> = (served.adapters.iter().enumerate())
            .filter(|&(k, _)| k != gone)
            .map(|(_, a)| a.copy())
            .collect();
        let all: Vec<&NamedAdapter> = kept.iter().collect();
        let mut stacks = BTreeMap::new();
        for (module, stacked) in &served.modules {
            let pairs = (0..served.adapters.len())
                .filter(|&k| k != gone)
                .map(|k| stacked.pair(k))
                .collect::<Result<Vec<_>>>()?;
            if let Some(stacked) = stack(&all, &pairs, module)? {
                evaluate(Why::Load, [&stacked.a, &stacked.b])?;
                stacks.insert(module.clone(), stacked);
            }
        }
        let slot = served.adapters[gone].slot;
        *served = Served::shared(kept, stacks);
        Ok(Some(slot))
    }

    /// The slot of the adapter called `name`.
    pub(crate) fn slot(&self, name: &str) -> Option<usize> {
        let served = lock(&self.served);
        served
            .adapters
            .iter()
            .find(|a| a.name == name)
            .map(|a| a.slot)
    }

    /// The names of the adapters served, in the order they were loaded.
    pub(crate) fn names(&self) -> Vec<String> {
        let served = lock(&self.served);
        served.adapters.iter().map(|a| a.name.clone()).collect()
    }

    /// The digest of the files of the adapter in `slot`, when it is served
    /// and was given one.
    pub(crate) fn digest(&self, slot: usize) -> Option<String> {
        let served = lock(&self.served);
        let adapter = served.adapters.iter().find(|a| a.slot == slot)?;
        adapter.digest.clone()
    }

    /// `base` wrapped, so that the pairs for `module` of the adapters
    /// served when a forward is built apply to its rows. Pairs served now
    /// whose shapes do not fit the layer are [`Error::Adapter`] naming the
    /// first adapter and the key.
    pub(crate) fn wrap(&self, module: &str, inputs: usize, base: Linear) -> Result<Linear> {
        let outputs = base.outputs();
        {
            let mut layers = lock(&self.layers);
            if !layers.built.contains_key(module) {
                layers.built.insert(module.to_owned(), (inputs, outputs));
            }
        }
        let served = Arc::clone(&lock(&self.served));
        if let Some(stacked) = served.modules.get(module) {
            let (a, b) = (stacked.a.shape(), stacked.b.shape());
            if a[1] as usize != inputs || b[2] as usize != outputs {
                let adapter = served.first_adapting(module);
                return Err(adapter_error(
                    &adapter.name,
                    &adapter.dir,
                    &format!(
                        "{module}.lora_a and .lora_b take {} inputs to {} outputs, the layer {inputs} to {outputs}",
                        a[1], b[2]
                    ),
                ));
            }
        }
        Ok(Box::new(RowLora {
            base,
            module: module.to_owned(),
        }))
    }

    /// Tells the adapters that the model is built: `matrices` are the
    /// modules of every matrix its files hold. Each pair served must adapt
    /// a layer built or one of them; the first that does not is
    /// [`Error::Adapter`].
    pub(crate) fn model_built(&self, matrices: BTreeSet<String>) -> Result<()> {
        let served = lock(&self.served);
        let mut layers = lock(&self.layers);
        let fits = |m: &str| layers.built.contains_key(m) || matrices.contains(m);
        if let Some(module) = served.modules.keys().find(|m| !fits(m)) {
            let adapter = served.first_adapting(module);
            return Err(adapter_error(
                &adapter.name,
                &adapter.dir,
                &format!("{module}.lora_a adapts no linear layer of the model"),
            ));
        }
        layers.matrices = Some(matrices);
        Ok(())
    }

    /// Runs `build` (a forward's graph) with row `i` under the adapter in
    /// slot `rows[i]` (or none).
    pub(crate) fn with_rows<T>(
        &self,
        rows: &[Option<usize>],
        build: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let served = Arc::clone(&lock(&self.served));
        let positions = rows
            .iter()
            .map(|r| {
                r.map(|slot| served.position(slot).ok_or_else(|| not_served(slot)))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let scales: Vec<f32> = served.adapters.iter().map(|a| a.scale).collect();
        let plan = plan_rows(&positions, &scales).map(|rows| RowPlan {
            served,
            strategy: self.strategy,
            rows,
        });
        with_plan(plan, build)
    }

    /// Runs `build` with every row of its forwards, whatever their number,
    /// under the adapter in `slot`.
    pub(crate) fn with_slot<T>(&self, slot: usize, build: impl FnOnce() -> Result<T>) -> Result<T> {
        let served = Arc::clone(&lock(&self.served));
        let position = served.position(slot).ok_or_else(|| not_served(slot))?;
        let plan = RowPlan {
            served,
            strategy: self.strategy,
            rows: PlanRows::Uniform(position),
        };
        with_plan(Some(plan), build)
    }
}

impl NamedAdapter {
    fn copy(&self) -> NamedAdapter {
        NamedAdapter {
            slot: self.slot,
            name: self.name.clone(),
            dir: self.dir.clone(),
            scale: self.scale,
            digest: self.digest.clone(),
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

/// A slot no adapter served holds (a fault of the runtime's: it refuses to
/// unload an adapter that rows use).
fn not_served(slot: usize) -> Error {
    Error::Adapter {
        name: format!("slot {slot}"),
        dir: PathBuf::new(),
        message: "no adapter served has this slot".to_owned(),
    }
}

fn adapter_error(name: &str, dir: &Path, message: &str) -> Error {
    Error::Adapter {
        name: name.to_owned(),
        dir: dir.to_path_buf(),
        message: message.to_owned(),
    }
}
