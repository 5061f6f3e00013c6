//! The download procedure: lock, fetch parts into `<file>.partial`, verify, rename.
//!
//! It is generic over [`PartSource`], so that everything but the network can be tested.

use crate::lock::LockGuard;
use crate::progress::Reporter;
use crate::{HubError, ModelSpec, Progress, WheelPart};
use sha2::{Digest, Sha256};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// The parts of a model as a source resolved them.
pub(crate) struct Plan<P> {
    /// One entry per [`WheelPart`] of the spec, in order.
    pub parts: Vec<P>,
    /// How many bytes fetching every part will transfer, when known (for progress).
    pub transfer_bytes: Option<u64>,
}

/// Where the chunks of a model come from.
pub(crate) trait PartSource {
    /// What resolving learns about one part.
    type Part;

    /// Looks up every part; called only when a download is actually needed.
    fn resolve(&mut self, parts: &[WheelPart]) -> Result<Plan<Self::Part>, HubError>;

    /// Writes the bytes of `part` to `out`, reporting transferred bytes to `reporter`.
    fn fetch(&mut self, part: &Self::Part, out: &mut Output, reporter: &mut Reporter) -> Result<(), HubError>;
}

/// The file being assembled, which hashes and counts what it is given.
pub(crate) struct Output {
    /// The `.partial` file.
    file: BufWriter<File>,
    /// Its path, for errors.
    path: PathBuf,
    /// Running sha256 of everything written.
    hasher: Sha256,
    /// Bytes written so far.
    written: u64,
    /// Bytes the finished file must have.
    expected: u64,
    /// The model's file name, for errors.
    name: String,
}

impl Output {
    /// Appends `buf`, refusing to grow past the expected size.
    pub(crate) fn write(&mut self, buf: &[u8]) -> Result<(), HubError> {
        let written = self.written + buf.len() as u64;
        if written > self.expected {
            return Err(HubError::SizeMismatch { what: self.name.clone(), expected: self.expected, actual: written });
        }
        self.file.write_all(buf).map_err(|e| HubError::io("write to", &self.path, e))?;
        self.hasher.update(buf);
        self.written = written;
        Ok(())
    }

    /// Checks the total size and sha256 against `spec`, then flushes and fsyncs the file.
    fn finish(self, spec: &ModelSpec) -> Result<(), HubError> {
        if self.written != spec.size {
            return Err(HubError::SizeMismatch { what: self.name, expected: spec.size, actual: self.written });
        }
        let actual = hex(&self.hasher.finalize());
        if !actual.eq_ignore_ascii_case(&spec.sha256) {
            return Err(HubError::HashMismatch { what: self.name, expected: spec.sha256.clone(), actual });
        }
        let file = self.file.into_inner().map_err(|e| HubError::io("write to", &self.path, e.into_error()))?;
        file.sync_all().map_err(|e| HubError::io("flush", &self.path, e))
    }
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `dir/<file name><suffix>`.
fn sibling(dir: &Path, spec: &ModelSpec, suffix: &str) -> PathBuf {
    dir.join(format!("{}{suffix}", spec.file_name))
}

/// Tells whether `path` holds the finished model; if its size is wrong and `remove_wrong`, deletes it.
fn is_present(spec: &ModelSpec, path: &Path, remove_wrong: bool) -> Result<bool, HubError> {
    match fs::metadata(path) {
        Ok(meta) if meta.is_file() && meta.len() == spec.size => Ok(true),
        Ok(meta) => {
            if remove_wrong {
                tracing::warn!("{} is {} bytes instead of {}; deleting it and downloading it again", path.display(), meta.len(), spec.size);
                fs::remove_file(path).map_err(|e| HubError::io("delete the damaged file", path, e))?;
            }
            Ok(false)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(HubError::io("inspect", path, e)),
    }
}

/// Returns `dir/<spec.file_name>`, downloading it from `source` first unless it is already there.
pub(crate) fn ensure_in<S: PartSource>(spec: &ModelSpec, dir: &Path, source: &mut S, progress: Progress) -> Result<PathBuf, HubError> {
    let path = dir.join(&spec.file_name);
    if is_present(spec, &path, false)? {
        return Ok(path);
    }
    fs::create_dir_all(dir).map_err(|e| HubError::io("create the directory", dir, e))?;
    let lock = LockGuard::acquire(&sibling(dir, spec, ".lock"))?;
    // Another process may have finished the download while we waited.
    if is_present(spec, &path, true)? {
        return Ok(path);
    }
    let partial = sibling(dir, spec, ".partial");
    let result = download(spec, &partial, source, progress).and_then(|()| {
        if lock.still_held() {
            Ok(())
        } else {
            Err(HubError::LockLost { path: sibling(dir, spec, ".lock") })
        }
    });
    if let Err(e) = result {
        if let Err(rm) = fs::remove_file(&partial) {
            if rm.kind() != io::ErrorKind::NotFound {
                tracing::warn!("could not delete {}: {rm}", partial.display());
            }
        }
        return Err(e);
    }
    fs::rename(&partial, &path).map_err(|e| HubError::io("rename the finished download to", &path, e))?;
    sync_dir(dir);
    tracing::info!("model saved to {}", path.display());
    Ok(path)
}

/// Fetches every part of `spec` from `source` into `partial` and verifies the result.
fn download<S: PartSource>(spec: &ModelSpec, partial: &Path, source: &mut S, progress: Progress) -> Result<(), HubError> {
    let plan = source.resolve(&spec.parts)?;
    if partial.exists() {
        tracing::info!("discarding the unfinished download {}", partial.display());
    }
    let file = OpenOptions::new().write(true).create(true).truncate(true).open(partial).map_err(|e| HubError::io("create", partial, e))?;
    let mut out = Output {
        file: BufWriter::with_capacity(1 << 20, file),
        path: partial.to_path_buf(),
        hasher: Sha256::new(),
        written: 0,
        expected: spec.size,
        name: spec.file_name.clone(),
    };
    let mut reporter = Reporter::new(progress, &spec.file_name, plan.transfer_bytes);
    let count = plan.parts.len();
    for (i, (wheel, part)) in spec.parts.iter().zip(&plan.parts).enumerate() {
        reporter.part(i + 1, count, &wheel.package);
        source.fetch(part, &mut out, &mut reporter)?;
    }
    out.finish(spec)?;
    reporter.finish();
    Ok(())
}

/// Makes a rename inside `dir` durable (best effort; a no-op where directories cannot be opened).
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        tracing::debug!("could not fsync {}: {e}", dir.display());
    }
    #[cfg(not(unix))]
    let _ = dir;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::temp_dir;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::thread;
    use std::time::Duration;

    /// A fake part: bytes to deliver, and whether to fail after delivering them.
    #[derive(Clone)]
    struct FakePart {
        data: Vec<u8>,
        fail: bool,
    }

    /// An in-memory source that counts how often it is used.
    struct Fake {
        parts: Vec<FakePart>,
        resolves: Arc<AtomicUsize>,
        delay: Duration,
    }

    impl Fake {
        fn new(parts: &[&[u8]]) -> Fake {
            Fake {
                parts: parts.iter().map(|d| FakePart { data: d.to_vec(), fail: false }).collect(),
                resolves: Arc::new(AtomicUsize::new(0)),
                delay: Duration::ZERO,
            }
        }
    }

    impl PartSource for Fake {
        type Part = FakePart;

        fn resolve(&mut self, parts: &[WheelPart]) -> Result<Plan<FakePart>, HubError> {
            assert_eq!(parts.len(), self.parts.len());
            self.resolves.fetch_add(1, Ordering::SeqCst);
            let total = self.parts.iter().map(|p| p.data.len() as u64).sum();
            Ok(Plan { parts: self.parts.clone(), transfer_bytes: Some(total) })
        }

        fn fetch(&mut self, part: &FakePart, out: &mut Output, reporter: &mut Reporter) -> Result<(), HubError> {
            for chunk in part.data.chunks(7) {
                thread::sleep(self.delay);
                out.write(chunk)?;
                reporter.advance(chunk.len() as u64);
            }
            if part.fail {
                return Err(HubError::HttpStatus { url: "https://example.org/part".into(), status: 503 });
            }
            Ok(())
        }
    }

    fn spec_for(parts: &[&[u8]]) -> ModelSpec {
        let whole = parts.concat();
        ModelSpec {
            file_name: "model.gguf".into(),
            sha256: hex(&Sha256::digest(&whole)),
            size: whole.len() as u64,
            parts: (0..parts.len())
                .map(|i| WheelPart {
                    package: format!("model-part{}", i + 1),
                    version: "1.0.0".into(),
                    member: format!("model_part{}/data/model.gguf.part{i:02}", i + 1),
                })
                .collect(),
        }
    }

    const PARTS: [&[u8]; 3] = [b"first chunk of the model, ", b"the second one, ", b"and the end."];

    /// Names of the files in `dir`, sorted.
    fn listing(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn downloads_joins_and_verifies() {
        let dir = temp_dir("dl-joins");
        let spec = spec_for(&PARTS);
        let mut fake = Fake::new(&PARTS);
        let path = ensure_in(&spec, &dir, &mut fake, Progress::Hidden).unwrap();
        assert_eq!(path, dir.join("model.gguf"));
        assert_eq!(fs::read(&path).unwrap(), PARTS.concat());
        assert_eq!(listing(&dir), ["model.gguf"]);
        // Second call: cached, the source is not consulted.
        ensure_in(&spec, &dir, &mut fake, Progress::Hidden).unwrap();
        assert_eq!(fake.resolves.load(Ordering::SeqCst), 1);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn present_file_of_the_right_size_is_trusted() {
        let dir = temp_dir("dl-trusted");
        let spec = spec_for(&PARTS);
        let same_size = vec![b'x'; spec.size as usize];
        fs::write(dir.join("model.gguf"), &same_size).unwrap();
        let mut fake = Fake::new(&PARTS);
        let path = ensure_in(&spec, &dir, &mut fake, Progress::Hidden).unwrap();
        assert_eq!(fs::read(path).unwrap(), same_size);
        assert_eq!(fake.resolves.load(Ordering::SeqCst), 0);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn present_file_of_the_wrong_size_is_downloaded_again() {
        let dir = temp_dir("dl-wrong-size");
        let spec = spec_for(&PARTS);
        fs::write(dir.join("model.gguf"), b"truncated").unwrap();
        let mut fake = Fake::new(&PARTS);
        let path = ensure_in(&spec, &dir, &mut fake, Progress::Hidden).unwrap();
        assert_eq!(fs::read(path).unwrap(), PARTS.concat());
        assert_eq!(fake.resolves.load(Ordering::SeqCst), 1);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn failing_source_leaves_no_file() {
        let dir = temp_dir("dl-failing");
        let spec = spec_for(&PARTS);
        let mut fake = Fake::new(&PARTS);
        fake.parts[1].fail = true;
        let err = ensure_in(&spec, &dir, &mut fake, Progress::Hidden).unwrap_err();
        assert!(matches!(err, HubError::HttpStatus { status: 503, .. }), "{err:?}");
        assert!(listing(&dir).is_empty(), "left behind: {:?}", listing(&dir));
        // The next attempt starts over and succeeds.
        fake.parts[1].fail = false;
        ensure_in(&spec, &dir, &mut fake, Progress::Hidden).unwrap();
        assert_eq!(fs::read(dir.join("model.gguf")).unwrap(), PARTS.concat());
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn wrong_hash_leaves_no_file() {
        let dir = temp_dir("dl-hash");
        let mut spec = spec_for(&PARTS);
        spec.sha256 = "0".repeat(64);
        let err = ensure_in(&spec, &dir, &mut Fake::new(&PARTS), Progress::Hidden).unwrap_err();
        assert!(matches!(err, HubError::HashMismatch { .. }), "{err:?}");
        assert!(err.to_string().contains("model.gguf"));
        assert!(listing(&dir).is_empty(), "left behind: {:?}", listing(&dir));
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn wrong_size_leaves_no_file() {
        let dir = temp_dir("dl-size");
        for size_delta in [-1i64, 1] {
            let mut spec = spec_for(&PARTS);
            spec.size = (spec.size as i64 + size_delta) as u64;
            let err = ensure_in(&spec, &dir, &mut Fake::new(&PARTS), Progress::Hidden).unwrap_err();
            assert!(matches!(err, HubError::SizeMismatch { .. }), "{err:?}");
            assert!(listing(&dir).is_empty(), "left behind: {:?}", listing(&dir));
        }
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn stale_partial_is_discarded() {
        let dir = temp_dir("dl-stale-partial");
        let spec = spec_for(&PARTS);
        fs::write(dir.join("model.gguf.partial"), vec![b'z'; 1000]).unwrap();
        ensure_in(&spec, &dir, &mut Fake::new(&PARTS), Progress::Hidden).unwrap();
        assert_eq!(fs::read(dir.join("model.gguf")).unwrap(), PARTS.concat());
        assert_eq!(listing(&dir), ["model.gguf"]);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn concurrent_callers_download_once() {
        let dir = temp_dir("dl-concurrent");
        let spec = spec_for(&PARTS);
        let resolves = Arc::new(AtomicUsize::new(0));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (dir, spec) = (dir.clone(), spec.clone());
                let mut fake = Fake::new(&PARTS);
                fake.resolves = resolves.clone();
                fake.delay = Duration::from_millis(20);
                thread::spawn(move || ensure_in(&spec, &dir, &mut fake, Progress::Hidden).unwrap())
            })
            .collect();
        for caller in callers {
            assert_eq!(fs::read(caller.join().unwrap()).unwrap(), PARTS.concat());
        }
        assert_eq!(resolves.load(Ordering::SeqCst), 1);
        assert_eq!(listing(&dir), ["model.gguf"]);
        fs::remove_dir_all(dir).unwrap();
    }
}
