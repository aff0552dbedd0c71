//! Fuzz target: both manifest parsers on arbitrary bytes.
//!
//! Beyond "no panic": a manifest that parses re-serializes, and that output parses
//! back to an equal manifest with no path that could escape its root.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stillpoint_wire::{CheckpointManifest, SnapshotManifest};

fuzz_target!(|data: &[u8]| {
    if let Ok(manifest) = SnapshotManifest::parse(data) {
        for file in &manifest.files {
            assert!(!file.path.as_str().starts_with('/'));
            assert!(!file.path.as_str().split('/').any(|c| c == ".."));
        }
        let bytes = manifest.to_bytes().expect("a parsed manifest serializes");
        assert_eq!(SnapshotManifest::parse(&bytes).expect("round trip"), manifest);
    }
    if let Ok(manifest) = CheckpointManifest::parse(data) {
        let bytes = manifest.to_bytes().expect("a parsed manifest serializes");
        assert_eq!(CheckpointManifest::parse(&bytes).expect("round trip"), manifest);
    }
});
