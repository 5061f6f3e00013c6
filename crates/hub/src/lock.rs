//! An exclusive, cross-process lock file built on `create_new`.
//!
//! The lock file holds the owner's pid, its pid namespace (Linux) and a random-ish
//! token. While held, a background thread refreshes the file's modification time.
//! A waiter breaks the lock when that heartbeat is older than [`STALE_AFTER`], or
//! at once on Linux when the owner's pid is gone from the waiter's own pid namespace.

use crate::HubError;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::{self, JoinHandle};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How often the owner refreshes the lock file's modification time.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// A lock whose heartbeat is older than this is considered abandoned.
const STALE_AFTER: Duration = Duration::from_secs(20);
/// How often a waiter re-checks the lock.
const POLL: Duration = Duration::from_millis(200);

/// An acquired lock; dropping it releases the lock.
#[derive(Debug)]
pub(crate) struct LockGuard {
    /// Path of the lock file.
    path: PathBuf,
    /// The exact content this guard wrote, to recognise our own lock.
    content: String,
    /// Stops the heartbeat thread when dropped or sent to.
    stop: Option<Sender<()>>,
    /// The heartbeat thread.
    heartbeat: Option<JoinHandle<()>>,
}

/// This process's pid namespace, e.g. `pid:[4026531836]`, where the OS exposes one.
fn pid_namespace() -> String {
    fs::read_link("/proc/self/ns/pid").map(|p| p.to_string_lossy().into_owned()).unwrap_or_default()
}

/// A token unique to one acquisition attempt within this machine.
fn unique_token() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{nanos:x}-{:x}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// Tells whether the lock with `content`, last refreshed at `modified`, was abandoned by its owner.
fn is_stale(content: &str, modified: SystemTime) -> bool {
    // An mtime in the future (clock skew) counts as fresh.
    if SystemTime::now().duration_since(modified).is_ok_and(|age| age > STALE_AFTER) {
        return true;
    }
    let mut lines = content.lines();
    let (Some(pid), Some(ns)) = (lines.next(), lines.next()) else {
        // Being written right now, or garbage; the heartbeat age decides.
        return false;
    };
    let ours = pid_namespace();
    // Same pid namespace and the pid no longer exists: the owner died.
    cfg!(target_os = "linux") && !ours.is_empty() && ns == ours && pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists()
}

impl LockGuard {
    /// Takes the lock at `path`, waiting while another live process or thread holds it.
    pub(crate) fn acquire(path: &Path) -> Result<LockGuard, HubError> {
        let content = format!("{}\n{}\n{}\n", std::process::id(), pid_namespace(), unique_token());
        let mut announced = false;
        loop {
            match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut file) => {
                    let written = file.write_all(content.as_bytes()).and_then(|()| file.sync_all());
                    if let Err(e) = written {
                        // Do not leave a half-written lock behind.
                        let _ = fs::remove_file(path);
                        return Err(HubError::io("write the lock file", path, e));
                    }
                    return Ok(LockGuard::start(path.to_path_buf(), content));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(HubError::io("create the lock file", path, e)),
            }
            let (held, modified) = match (fs::read_to_string(path), fs::metadata(path).and_then(|m| m.modified())) {
                (Ok(held), Ok(modified)) => (held, modified),
                // Released between our attempts: try again at once.
                (Err(e), _) | (_, Err(e)) if e.kind() == io::ErrorKind::NotFound => continue,
                (Err(e), _) | (_, Err(e)) => return Err(HubError::io("read the lock file", path, e)),
            };
            if is_stale(&held, modified) {
                tracing::warn!("removing stale lock {} left by an interrupted download", path.display());
                break_lock(path, &held)?;
                continue;
            }
            if !announced {
                let owner = held.lines().next().unwrap_or("?");
                tracing::info!("waiting for another kiln process (pid {owner}) that holds {}", path.display());
                announced = true;
            }
            thread::sleep(POLL);
        }
    }

    /// Wraps an acquired lock and starts its heartbeat.
    fn start(path: PathBuf, content: String) -> LockGuard {
        let (stop, stopped) = mpsc::channel::<()>();
        let beat_path = path.clone();
        let heartbeat = thread::Builder::new()
            .name("kiln-hub-lock".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(HEARTBEAT) {
                    let touched = OpenOptions::new().write(true).open(&beat_path).and_then(|f| f.set_modified(SystemTime::now()));
                    if let Err(e) = touched {
                        tracing::debug!("could not refresh lock {}: {e}", beat_path.display());
                    }
                }
            })
            .map_err(|e| tracing::warn!("no heartbeat for lock {}: {e}", path.display()))
            .ok();
        LockGuard { path, content, stop: Some(stop), heartbeat }
    }

    /// Tells whether the lock file still holds this guard's content (nobody broke it).
    pub(crate) fn still_held(&self) -> bool {
        fs::read_to_string(&self.path).is_ok_and(|c| c == self.content)
    }
}

/// Removes the abandoned lock at `path` whose content was `stale`, without removing a fresh one.
fn break_lock(path: &Path, stale: &str) -> Result<(), HubError> {
    // Move the lock aside atomically, so that only one waiter gets that exact file.
    let aside = path.with_extension(format!("lock.stale-{}-{}", std::process::id(), unique_token()));
    match fs::rename(path, &aside) {
        Ok(()) => {}
        // Someone else broke or released it first.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(HubError::io("remove the stale lock file", path, e)),
    }
    let taken = fs::read_to_string(&aside).unwrap_or_default();
    if taken != stale {
        // We moved a lock that was re-taken meanwhile: put it back unless yet another one exists.
        if fs::hard_link(&aside, path).is_err() {
            tracing::warn!("lock {} changed hands while being broken", path.display());
        }
    }
    fs::remove_file(&aside).map_err(|e| HubError::io("remove the stale lock file", &aside, e))
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(handle) = self.heartbeat.take() {
            let _ = handle.join();
        }
        if self.still_held() {
            if let Err(e) = fs::remove_file(&self.path) {
                tracing::warn!("could not remove lock file {}: {e}", self.path.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{age_file, temp_dir};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn lock_is_exclusive_and_released_on_drop() {
        let dir = temp_dir("lock-exclusive");
        let path = dir.join("m.lock");
        let guard = LockGuard::acquire(&path).unwrap();
        assert!(guard.still_held());
        let inside = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (path, inside) = (path.clone(), inside.clone());
            thread::spawn(move || {
                let g = LockGuard::acquire(&path).unwrap();
                inside.store(true, Ordering::SeqCst);
                drop(g);
            })
        };
        thread::sleep(Duration::from_millis(600));
        assert!(!inside.load(Ordering::SeqCst), "second holder got in while the lock was held");
        drop(guard);
        waiter.join().unwrap();
        assert!(inside.load(Ordering::SeqCst));
        assert!(!path.exists(), "lock file left behind");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn abandoned_lock_is_broken() {
        let dir = temp_dir("lock-abandoned");
        let path = dir.join("m.lock");
        // A live pid (ours) but no heartbeat for a long time.
        fs::write(&path, format!("{}\n{}\nold\n", std::process::id(), pid_namespace())).unwrap();
        age_file(&path, Duration::from_secs(3600));
        let start = Instant::now();
        let guard = LockGuard::acquire(&path).unwrap();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(guard.still_held());
        drop(guard);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "leftover files");
        fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn lock_of_a_dead_process_is_broken_at_once() {
        let dir = temp_dir("lock-dead");
        let path = dir.join("m.lock");
        // Far above any pid_max, so no such process exists.
        fs::write(&path, format!("999999999\n{}\nx\n", pid_namespace())).unwrap();
        let start = Instant::now();
        drop(LockGuard::acquire(&path).unwrap());
        assert!(start.elapsed() < Duration::from_secs(5));
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn fresh_lock_of_a_live_process_is_not_stale() {
        let content = format!("{}\n{}\nx\n", std::process::id(), pid_namespace());
        assert!(!is_stale(&content, SystemTime::now()));
        assert!(!is_stale("", SystemTime::now()));
        assert!(is_stale(&content, SystemTime::now() - Duration::from_secs(3600)));
        // Another pid namespace: only the heartbeat counts.
        assert!(!is_stale("999999999\npid:[1]\nx\n", SystemTime::now()));
    }

    #[test]
    fn breaking_never_removes_a_lock_that_changed_hands() {
        let dir = temp_dir("lock-changed");
        let path = dir.join("m.lock");
        fs::write(&path, "fresh").unwrap();
        break_lock(&path, "stale content").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "fresh");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "leftover files");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn heartbeat_keeps_the_lock_fresh() {
        let dir = temp_dir("lock-heartbeat");
        let path = dir.join("m.lock");
        let guard = LockGuard::acquire(&path).unwrap();
        age_file(&path, Duration::from_secs(3600));
        thread::sleep(HEARTBEAT + Duration::from_millis(700));
        let modified = fs::metadata(&path).unwrap().modified().unwrap();
        assert!(!is_stale(&fs::read_to_string(&path).unwrap(), modified));
        drop(guard);
        fs::remove_dir_all(dir).unwrap();
    }
}
