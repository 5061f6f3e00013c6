//! The official `openai` Python client (pinned, from PyPI) against an in-process server: runs
//! `tests/openai_client.py`. The client is installed into a virtual environment under the cargo
//! target directory the first time; Python 3 with `venv` and access to PyPI are required (the test
//! fails, with the reason, without them).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The pinned client version.
const OPENAI_VERSION: &str = "3.57.0";

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A virtual environment with `openai==OPENAI_VERSION`, created when missing; returns its python.
fn python_with_openai() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("openai-{OPENAI_VERSION}-venv"));
    let python = venv.join("bin").join("python");
    let ready = venv.join(".installed");
    if !ready.exists() {
        let _ = std::fs::remove_dir_all(&venv);
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv), "creating a Python venv (needs python3 with venv)");
        run(
            Command::new(&python).args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                &format!("openai=={OPENAI_VERSION}"),
            ]),
            "installing the openai client from PyPI",
        );
        std::fs::write(&ready, OPENAI_VERSION).unwrap();
    }
    python
}

#[test]
fn the_official_openai_client_works_against_the_server() {
    let python = python_with_openai();
    let server = common::start(4, 16);
    let base_url = format!("http://{}/v1", server.addr());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("openai_client.py");
    run(Command::new(&python).arg(&script).arg(&base_url).arg(common::MODEL_ID), "tests/openai_client.py");
    server.shutdown().unwrap();
}
