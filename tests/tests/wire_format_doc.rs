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
use stillpoint_wire::{
    Envelope, FrameDecoder, MessageKind, Record, decode_batch, encode_batch, encode_to_bytes,
    read_envelope, write_envelope,
};

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
    let frames = examples
        .iter()
        .filter(|(heading, _)| heading.starts_with(|c: char| c.is_ascii_digit()));
    for (heading, bytes) in frames {
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

/// The record batch and envelope examples decode to what their headings say and
/// re-encode to the same bytes.
#[test]
fn the_record_batch_and_envelope_examples_decode() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/wire-format.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let examples = examples(&doc);
    let find = |prefix: &str| -> Vec<u8> {
        examples
            .iter()
            .find(|(heading, _)| heading.starts_with(prefix))
            .unwrap_or_else(|| panic!("no example under `{prefix}…`"))
            .1
            .clone()
    };
    for (prefix, first_time) in [
        ("Record batch: ", None),
        ("Record batch with an event time", Some(1_000)),
    ] {
        let batch = find(prefix);
        let records = decode_batch(&Bytes::from(batch.clone())).unwrap();
        let the = Record::new("the", "1");
        let the = match first_time {
            Some(time) => the.at(time),
            None => the,
        };
        assert_eq!(records, [the, Record::new("quick", "2")], "{prefix}");
        assert_eq!(&encode_batch(&records)[..], &batch[..], "{prefix}");
    }

    let decoder = FrameDecoder::default();
    for (prefix, expect) in [
        ("Envelope: the Barrier", "wire"),
        ("Envelope: `{\"type\":\"ready\"", "engine"),
    ] {
        let bytes = find(prefix);
        let envelope = read_envelope(&mut bytes.as_slice(), decoder).unwrap();
        match (&envelope, expect) {
            (
                Envelope::Wire {
                    generation,
                    message,
                },
                "wire",
            ) => {
                assert_eq!(*generation, 3);
                assert_eq!(message.kind(), MessageKind::Barrier);
            }
            (Envelope::Engine(message), "engine") => {
                assert_eq!(
                    *message,
                    stillpoint_wire::EngineMessage::Ready { generation: 3 }
                );
            }
            other => panic!("`{prefix}` decodes to {other:?}"),
        }
        let mut again = Vec::new();
        write_envelope(&mut again, &envelope).unwrap();
        assert_eq!(again, bytes, "`{prefix}` re-encodes differently");
    }
}
