//! A purpose-built thread pool for per-op parallelism: the caller runs tasks too, idle workers
//! spin briefly before sleeping, so waking them between back-to-back ops costs well under a
//! microsecond while the engine is busy and nothing while it is idle.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_millis(2);

type TaskFn = dyn Fn(usize) + Sync;

/// One parallel loop: tasks `0..n` of a borrowed closure.
struct Job {
    /// The closure, with its lifetime erased; valid until `done == n` (see `ThreadPool::run`).
    f: *const TaskFn,
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
}

// SAFETY: `f` points to a `Sync` closure that outlives every use (run() waits for all tasks).
unsafe impl Send for Job {}
// SAFETY: as above; the counters are atomics.
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs tasks until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            // SAFETY: i < n, so run() is still waiting for this task and the closure is alive.
            unsafe { (*self.f)(i) };
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct Shared {
    job: Mutex<Option<Arc<Job>>>,
    generation: AtomicU64,
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

/// A fixed set of worker threads plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl ThreadPool {
    /// A pool running tasks on `threads` threads in all (the caller included; 0 means one per core).
    pub fn new(threads: usize) -> Self {
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            generation: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads)
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("kiln-cpu-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("spawning a CPU worker thread")
            })
            .collect();
        ThreadPool { shared, workers }
    }

    /// Threads that run tasks (workers plus the caller).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0..n)` across the pool and returns when every task has finished.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n <= 1 || self.workers.is_empty() {
            (0..n).for_each(f);
            return;
        }
        // SAFETY: only the lifetime is erased; this function does not return before every task
        // that dereferences `f` has completed (done == n), and later claims (i >= n) never touch it.
        let f: *const TaskFn = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static TaskFn>(f) };
        let job = Arc::new(Job { f, n, next: AtomicUsize::new(0), done: AtomicUsize::new(0) });
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(job.clone());
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        if self.shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        job.work();
        while job.done.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
    }

    /// Splits `0..len` into contiguous chunks of at least `min_chunk` items and runs
    /// `f(start..end)` for each, in parallel. Chunks are claimed in order, each a share of what is
    /// left (large first, small last), so the threads finish together; where the chunks fall
    /// depends on timing, so `f`'s results must not depend on them.
    pub fn for_chunks(&self, len: usize, min_chunk: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let min_chunk = min_chunk.max(1);
        let threads = self.threads();
        if len == 0 {
            return;
        }
        if threads == 1 || len <= min_chunk {
            f(0..len);
            return;
        }
        self.for_chunks_with(len, min_chunk, &|_, chunk| f(chunk));
    }

    /// Runs `f(participant, start..end)` over chunks of `0..len` as [`ThreadPool::for_chunks`]
    /// does, where `participant < self.threads()` is the same for every chunk one thread claims
    /// (so per-participant state, e.g. a running best, needs no locking).
    pub fn for_chunks_with(&self, len: usize, min_chunk: usize, f: &(dyn Fn(usize, std::ops::Range<usize>) + Sync)) {
        let (min_chunk, threads) = (min_chunk.max(1), self.threads());
        let next = AtomicUsize::new(0);
        self.run(threads, &|p| {
            while let Some(chunk) = claim_chunk(&next, len, min_chunk, threads) {
                f(p, chunk);
            }
        });
    }
}

/// Claims the next chunk of `0..len` from the shared cursor `next`: a `1 / (2 · threads)` share of
/// what is left, at least `min_chunk` items; `None` once nothing is left.
fn claim_chunk(next: &AtomicUsize, len: usize, min_chunk: usize, threads: usize) -> Option<std::ops::Range<usize>> {
    let mut start = next.load(Ordering::Relaxed);
    loop {
        if start >= len {
            return None;
        }
        let end = (start + ((len - start) / (2 * threads)).max(min_chunk)).min(len);
        match next.compare_exchange_weak(start, end, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(start..end),
            Err(now) => start = now,
        }
    }
}

fn worker(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while shared.generation.load(Ordering::Acquire) == seen && !shared.shutdown.load(Ordering::Acquire) {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && start.elapsed() > SPIN {
                let mut guard = shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                shared.sleepers.fetch_add(1, Ordering::SeqCst);
                while shared.generation.load(Ordering::SeqCst) == seen && !shared.shutdown.load(Ordering::SeqCst) {
                    guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                shared.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        seen = shared.generation.load(Ordering::Acquire);
        let job = shared.job.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(job) = job {
            job.work();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _guard = self.shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_once() {
        let pool = ThreadPool::new(3);
        for n in [0, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn chunks_cover_the_range() {
        let pool = ThreadPool::new(2);
        let sum = AtomicUsize::new(0);
        pool.for_chunks(12345, 100, &|r| {
            sum.fetch_add(r.map(|i| i + 1).sum::<usize>(), Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 12345 * 12346 / 2);
    }

    #[test]
    fn chunks_with_participants_cover_the_range_once() {
        let pool = ThreadPool::new(3);
        for (len, min_chunk) in [(0, 4), (1, 4), (7, 1), (1000, 16), (12345, 100)] {
            let hits: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
            let chunks = AtomicUsize::new(0);
            pool.for_chunks_with(len, min_chunk, &|p, r| {
                assert!(p < pool.threads());
                assert!(r.len() >= min_chunk.min(len) || r.end == len, "chunk {r:?} below {min_chunk}");
                chunks.fetch_add(1, Ordering::Relaxed);
                r.for_each(|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "len {len}");
            assert!(chunks.load(Ordering::Relaxed) <= len.div_ceil(min_chunk));
        }
    }

    #[test]
    fn survives_sleeping_workers() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN * 3);
        let count = AtomicUsize::new(0);
        pool.run(64, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 64);
    }
}
