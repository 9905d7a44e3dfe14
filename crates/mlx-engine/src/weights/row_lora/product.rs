//! A linear layer with per-row adapters, and the plan of which adapter
//! each row of the forward being built uses.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use mlx_rs::ops::indexing::{IndexOp, TryIndexOp};
use mlx_rs::ops::{concatenate, expand_dims_axes, select, zeros_dtype};
use mlx_rs::Array;
use mlx_support::Quantization;

use super::stack::Stacked;
use super::{current_plan, Served, Strategy};
use crate::error::{Error, Result};
use crate::weights::linear::{Linear, LinearProduct};

/// Which adapter the rows of a forward use, among the adapters served
/// when its graph was built.
pub(crate) struct RowPlan {
    pub(super) served: Arc<Served>,
    pub(super) strategy: Strategy,
    pub(super) rows: PlanRows,
}

impl std::fmt::Debug for RowPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowPlan")
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
pub(super) enum PlanRows {
    /// Every row, whatever their number, the adapter at this position.
    Uniform(usize),
    /// Each row its own (see [`Rows`]).
    PerRow(Rows),
}

/// The rows of one forward by adapter, as the layers gather their pairs
/// (or their rows, by adapter).
#[derive(Debug)]
pub(super) struct Rows {
    rows: usize,
    /// Per adapter in use: its position and its rows, ascending.
    groups: Vec<(usize, Array, i32)>,
    /// Rows of no adapter.
    plain: i32,
    /// Row `i`'s place in the gathered order (groups, then plain rows).
    back: Array,
    /// Each row's adapter position (0 for a row of none: masked out).
    positions: Array,
    /// Each row's adapter's scale (f32).
    scales: Array,
    /// Whether row `i` has an adapter.
    adapted: Array,
}

/// `None` when no row has an adapter: the layers then run the base
/// product alone; [`PlanRows::Uniform`] when every row has the same.
/// `rows[i]`: row `i`'s adapter's position among `scales`, if any.
pub(super) fn plan_rows(rows: &[Option<usize>], scales: &[f32]) -> Option<PlanRows> {
    match rows.first() {
        None => return None,
        Some(&first) if rows.iter().all(|&r| r == first) => return first.map(PlanRows::Uniform),
        Some(_) => {}
    }
    let mut order: Vec<usize> = Vec::with_capacity(rows.len());
    let mut groups = Vec::new();
    for position in 0..scales.len() {
        let members: Vec<i32> = (0..rows.len())
            .filter(|&i| rows[i] == Some(position))
            .map(|i| i as i32)
            .collect();
        if members.is_empty() {
            continue;
        }
        order.extend(members.iter().map(|&i| i as usize));
        let n = members.len() as i32;
        groups.push((position, Array::from_slice(&members, &[n]), n));
    }
    let plain: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].is_none()).collect();
    order.extend(&plain);
    let mut back = vec![0i32; rows.len()];
    for (place, &row) in order.iter().enumerate() {
        back[row] = place as i32;
    }
    let n = rows.len() as i32;
    let position_of: Vec<i32> = rows.iter().map(|r| r.unwrap_or(0) as i32).collect();
    let scale_of: Vec<f32> = rows.iter().map(|r| r.map_or(0.0, |s| scales[s])).collect();
    let adapted: Vec<bool> = rows.iter().map(Option::is_some).collect();
    Some(PlanRows::PerRow(Rows {
        rows: rows.len(),
        groups,
        plain: plain.len() as i32,
        back: Array::from_slice(&back, &[n]),
        positions: Array::from_slice(&position_of, &[n]),
        scales: Array::from_slice(&scale_of, &[n]),
        adapted: Array::from_slice(&adapted, &[n]),
    }))
}

/// mlx_lm's delta `(s · (x·A)·B)` cast to `x`'s dtype, `scale` an array
/// that broadcasts over the product (one value, or one per row).
fn delta(x: &Array, a: &Array, b: &Array, scale: &Array) -> Result<Array> {
    let z = x.matmul(a)?.matmul(b)?;
    Ok(z.multiply(scale.as_dtype(z.dtype())?)?
        .as_dtype(x.dtype())?)
}

/// A linear layer with per-row adapters (see the module's docs): the base
/// product, and the pairs of `module` that the plan of the forward being
/// built holds.
pub(super) struct RowLora {
    pub base: Linear,
    pub module: String,
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
        let Some(plan) = current_plan() else {
            return Ok(y);
        };
        let Some(stacked) = plan.served.modules.get(&self.module) else {
            return Ok(y);
        };
        let rows = match &plan.rows {
            &PlanRows::Uniform(position) => {
                let (a, b) = part(&stacked.a, &stacked.b)?;
                let scale = plan.served.adapters[position].scale;
                return match one_adapter(stacked, x, &a, &b, position, scale)? {
                    Some(delta) => Ok(y.add(delta)?),
                    None => Ok(y),
                };
            }
            PlanRows::PerRow(rows) => rows,
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
        let (a, b) = part(&stacked.a, &stacked.b)?;
        if plan.strategy == Strategy::Segments {
            return by_adapter(stacked, &plan.served, x, y, rows, &a, &b);
        }
        // Each row's pair, `(B, in, r)` and `(B, r, out)`, and the rows as
        // `(B, L, in)`: one batched product for every adapter at once.
        let (a, b) = (
            a.take_axis(&rows.positions, 0)?,
            b.take_axis(&rows.positions, 0)?,
        );
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

/// The delta of `x` under the adapter at `position` (`a`, `b` the stacks'
/// parts), `None` where it does not adapt this layer.
fn one_adapter(
    stacked: &Stacked,
    x: &Array,
    a: &Array,
    b: &Array,
    position: usize,
    scale: f32,
) -> Result<Option<Array>> {
    let rank = stacked.ranks[position] as i32;
    if rank == 0 {
        return Ok(None);
    }
    let a = a.index((position as i32, .., ..rank));
    let b = b.index((position as i32, ..rank, ..));
    Ok(Some(delta(x, &a, &b, &Array::from_f32(scale))?))
}

/// [`Strategy::Segments`]: each adapter's rows gathered and multiplied by
/// its pair; the deltas put back in row order.
fn by_adapter(
    stacked: &Stacked,
    served: &Served,
    x: &Array,
    y: Array,
    rows: &Rows,
    a: &Array,
    b: &Array,
) -> Result<Array> {
    let tail: Vec<i32> = y.shape()[1..].to_vec();
    let zeros = |n: i32| -> Result<Array> {
        let shape: Vec<i32> = std::iter::once(n).chain(tail.iter().copied()).collect();
        Ok(zeros_dtype(&shape, y.dtype())?)
    };
    let mut parts = Vec::with_capacity(rows.groups.len() + 1);
    for &(position, ref members, n) in &rows.groups {
        let scale = served.adapters[position].scale;
        let members = x.take_axis(members, 0)?;
        match one_adapter(stacked, &members, a, b, position, scale)? {
            Some(delta) => parts.push(delta),
            None => parts.push(zeros(n)?),
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

    /// The base's where no row of the forward being built has an adapter
    /// of this layer, so that a layer no adapter of the moment adapts runs
    /// as it would unwrapped; `None` (products whole) where one has.
    fn slice_group(&self) -> Option<Quantization> {
        let adapted = current_plan().is_some_and(|plan| {
            let stacked = plan.served.modules.get(&self.module);
            match (&plan.rows, stacked) {
                (_, None) => false,
                (&PlanRows::Uniform(position), Some(s)) => s.ranks[position] > 0,
                (PlanRows::PerRow(rows), Some(s)) => {
                    rows.groups.iter().any(|&(p, _, _)| s.ranks[p] > 0)
                }
            }
        });
        match adapted {
            true => None,
            false => self.base.slice_group(),
        }
    }
}
