//! `docs/wire-format.md` is the byte-level spec: every hex example in it must decode
//! to a message of the kind its section names and re-encode to the same bytes, and
//! every message kind must have an example.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeSet;

use bytes::Bytes;
use stillpoint_wire::{FrameDecoder, MessageKind, encode_to_bytes};

/// `(section heading, bytes)` for every ```hex block.
fn examples(doc: &str) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut heading = String::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        if let Some(h) = line.strip_prefix("### ") {
            heading = h.trim().to_owned();
        } else if line.trim() == "```hex" {
            let mut bytes = Vec::new();
            for hex_line in lines.by_ref().take_while(|l| l.trim() != "```") {
                for byte in hex_line.split_whitespace() {
                    bytes.push(
                        u8::from_str_radix(byte, 16)
                            .unwrap_or_else(|_| panic!("bad hex {byte:?} under {heading}")),
                    );
                }
            }
            out.push((heading.clone(), bytes));
        }
    }
    out
}

#[test]
fn every_example_in_the_wire_format_spec_decodes() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/wire-format.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let examples = examples(&doc);
    let decoder = FrameDecoder::default();
    let mut covered = BTreeSet::new();
    for (heading, bytes) in &examples {
        let message = decoder
            .decode_exact(Bytes::copy_from_slice(bytes))
            .unwrap_or_else(|e| panic!("example under `{heading}` does not decode: {e}"));
        let kind = message.kind();
        assert_eq!(
            heading,
            &format!("{} {}", kind.code(), kind.name()),
            "example under the wrong heading"
        );
        assert_eq!(
            &encode_to_bytes(&message).unwrap()[..],
            &bytes[..],
            "`{heading}` re-encodes differently"
        );
        covered.insert(kind);
    }
    let missing: Vec<MessageKind> = MessageKind::ALL
        .into_iter()
        .filter(|k| !covered.contains(k))
        .collect();
    assert!(missing.is_empty(), "no example for {missing:?}");
}
