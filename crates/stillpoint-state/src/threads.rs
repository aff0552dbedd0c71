//! Work spread over the cores, for what runs before a task processes anything (a
//! restore's hashing and replay) and so may use every core.

use std::sync::Mutex;

/// Threads [`threads`] gives at most.
const MAX_THREADS: usize = 8;

/// Threads to spread work that may use every core over: one per core, up to
/// [`MAX_THREADS`].
pub(crate) fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .clamp(1, MAX_THREADS)
}

/// Runs `work` on each of `inputs`, the first on the calling thread and each other on
/// a thread of its own (on the calling thread too when one cannot be started); the
/// results in the order of `inputs`.
pub(crate) fn on_threads<I: Send, T: Send>(inputs: Vec<I>, work: impl Fn(I) -> T + Sync) -> Vec<T> {
    let count = inputs.len();
    let slots: Vec<Mutex<Option<I>>> = inputs.into_iter().map(|i| Mutex::new(Some(i))).collect();
    // Each input is taken once: by its thread, or here when its thread did not start.
    let take = |i: usize| slots.get(i).and_then(|slot| slot.lock().ok()?.take());
    let work = &work;
    std::thread::scope(|scope| {
        let threads: Vec<Option<std::thread::ScopedJoinHandle<'_, Option<T>>>> = (1..count)
            .map(|i| {
                std::thread::Builder::new()
                    .name("stillpoint-state".into())
                    .spawn_scoped(scope, move || take(i).map(work))
                    .ok()
            })
            .collect();
        let mut results = Vec::with_capacity(count);
        results.extend(take(0).map(work));
        for (i, thread) in (1..count).zip(threads) {
            let result = match thread {
                Some(thread) => thread
                    .join()
                    // A panic in a worker thread is a bug: raised here as it would be
                    // had the work run on this thread.
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                None => take(i).map(work),
            };
            results.extend(result);
        }
        results
    })
}

/// Runs `work` on each of `items` on up to `threads` threads, each thread taking a run
/// of consecutive items (so a thread reads neighbouring files or memory); the results
/// in the order of `items`.
pub(crate) fn each_on_threads<I: Sync, T: Send>(
    items: &[I],
    threads: usize,
    work: impl Fn(&I) -> T + Sync,
) -> Vec<T> {
    let runs: Vec<&[I]> = items.chunks(items.len().div_ceil(threads).max(1)).collect();
    on_threads(runs, |run| run.iter().map(&work).collect::<Vec<T>>())
        .into_iter()
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input is worked on once, on however many threads, and the results come
    /// back in the order of the inputs.
    #[test]
    fn each_input_is_worked_once_and_results_keep_their_order() {
        for count in [0_usize, 1, 2, 5, 17] {
            let worked = std::sync::atomic::AtomicUsize::new(0);
            let results = on_threads((0..count).collect(), |i| {
                worked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                (i, std::thread::current().name().map(str::to_owned))
            });
            assert_eq!(worked.into_inner(), count);
            let order: Vec<usize> = results.iter().map(|r| r.0).collect();
            assert_eq!(order, (0..count).collect::<Vec<_>>());
            // The first on the calling thread, each other on a worker.
            for (i, name) in results {
                if i > 0 {
                    assert_eq!(name.as_deref(), Some("stillpoint-state"));
                }
            }
        }
        assert!((1..=MAX_THREADS).contains(&threads()));
    }

    /// Each item once, in order, however the items divide among the threads.
    #[test]
    fn each_item_is_worked_once_in_order_over_runs() {
        for (count, threads) in [(0_usize, 2_usize), (1, 4), (5, 2), (7, 3), (9, 1), (3, 8)] {
            let items: Vec<usize> = (0..count).collect();
            let worked = std::sync::atomic::AtomicUsize::new(0);
            let doubled = each_on_threads(&items, threads, |i| {
                worked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                i * 2
            });
            assert_eq!(worked.into_inner(), count);
            assert_eq!(doubled, items.iter().map(|i| i * 2).collect::<Vec<_>>());
        }
    }
}
