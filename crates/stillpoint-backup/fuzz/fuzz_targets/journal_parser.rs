//! Fuzz target: the progress journal's file parser on arbitrary bytes.
//!
//! Beyond "no panic": a file that parses re-encodes to exactly its bytes; any body
//! (the input itself) sealed by `encode` parses back to the same kind, elapsed time
//! and body; and decoding such a body as records or summaries — what `resume` does
//! with a verified file — fails cleanly or succeeds, never panics.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use stillpoint_backup::journal::{JournalFile, JournalFileKind};

type Records = Vec<(String, Vec<serde_json::Value>)>;
type Summaries = Vec<(String, serde_json::Value)>;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = JournalFile::parse(data) {
        assert_eq!(JournalFile::encode(file.kind, file.elapsed, file.body), data);
    }
    let kind = if data.first().is_some_and(|b| b & 1 == 1) {
        JournalFileKind::Summaries
    } else {
        JournalFileKind::Records
    };
    let elapsed = Duration::from_millis(u64::from(data.len() as u32) * 7);
    let sealed = JournalFile::encode(kind, elapsed, data);
    let file = JournalFile::parse(&sealed).expect("an encoded file parses");
    assert_eq!((file.kind, file.elapsed, file.body), (kind, elapsed, data));
    match kind {
        JournalFileKind::Records => drop(serde_json::from_slice::<Records>(file.body)),
        JournalFileKind::Summaries => drop(serde_json::from_slice::<Summaries>(file.body)),
    }
});
