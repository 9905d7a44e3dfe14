//! The threads a product is shared out over: a pool the caller owns, not
//! rayon's global one, so that an application decides what runs where.

/// A pool of threads for the kernels, made and owned by the caller (one per
/// loaded model in mlx-engine).
#[derive(Debug)]
pub struct Pool {
    /// `None` for one thread: the caller's own runs everything.
    threads: Option<rayon::ThreadPool>,
    count: usize,
}

impl Pool {
    /// A pool of `threads` threads (at least one; one starts none: products
    /// run on the calling thread).
    ///
    /// # Errors
    /// [`Error::Pool`](crate::Error::Pool) when the threads cannot start.
    pub fn new(threads: usize) -> crate::Result<Pool> {
        let count = threads.max(1);
        let threads = if count == 1 {
            None
        } else {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(count)
                    .thread_name(|i| format!("cpu-kernels-{i}"))
                    .build()?,
            )
        };
        Ok(Pool { threads, count })
    }

    /// The pool's thread count.
    pub fn threads(&self) -> usize {
        self.count
    }

    /// Up to `threads` of the pool's threads for one product (at least one;
    /// one runs on the calling thread).
    pub fn workers(&self, threads: usize) -> Workers<'_> {
        Workers {
            pool: self.threads.as_ref(),
            threads: threads.clamp(1, self.count),
        }
    }
}

/// The threads one product may use: some of a [`Pool`]'s, or the calling
/// thread alone ([`Workers::inline`]). The results do not depend on it.
#[derive(Debug, Clone, Copy)]
pub struct Workers<'a> {
    pool: Option<&'a rayon::ThreadPool>,
    threads: usize,
}

impl Workers<'_> {
    /// The calling thread alone.
    pub fn inline() -> Workers<'static> {
        Workers {
            pool: None,
            threads: 1,
        }
    }

    /// How many threads share the product.
    pub fn threads(&self) -> usize {
        match self.pool {
            Some(_) => self.threads,
            None => 1,
        }
    }

    /// Runs `task(i)` for every `i < tasks`, on the pool's threads when
    /// there are more than one (the caller waits), else in order here.
    pub(crate) fn each(&self, tasks: usize, task: impl Fn(usize) + Sync) {
        match self.pool {
            Some(pool) if self.threads > 1 => pool.install(|| {
                use rayon::prelude::*;
                (0..tasks).into_par_iter().for_each(&task);
            }),
            _ => (0..tasks).for_each(task),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn every_task_runs_once_whatever_the_threads() {
        let pool = Pool::new(3).unwrap();
        assert_eq!(pool.threads(), 3);
        for workers in [
            Workers::inline(),
            pool.workers(1),
            pool.workers(2),
            pool.workers(9),
        ] {
            let runs: Vec<AtomicUsize> = (0..50).map(|_| AtomicUsize::new(0)).collect();
            workers.each(50, |i| {
                runs[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
        }
        assert_eq!(pool.workers(9).threads(), 3, "no more than the pool has");
        assert_eq!(pool.workers(0).threads(), 1);
        assert_eq!(Pool::new(0).unwrap().threads(), 1);
    }
}
