//! Fuzz target: the changelog segment decoder on arbitrary bytes.
//!
//! The input is decoded as it is (almost always a checksum mismatch) and resealed:
//! with its own CRC32C appended, so the fuzzer reaches the decoder behind the
//! checksum. Beyond "no panic": what decodes has each state's keys strictly
//! increasing and at least a key group long, and re-encodes to the very bytes it
//! came from (the decoder accepts only the encoder's one form).
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use stillpoint_wire::{KeyGroupRange, SegmentWrite, decode_segment, encode_segment};

const ALL: KeyGroupRange = KeyGroupRange {
    start: 0,
    end: 1 << 16,
};

fuzz_target!(|data: &[u8]| {
    let _ = decode_segment(Bytes::copy_from_slice(data), ALL);
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    let Ok(blocks) = decode_segment(Bytes::copy_from_slice(&sealed), ALL) else {
        return;
    };
    for (_, batch) in &blocks {
        assert!(
            batch.iter().all(|(key, _)| key.len() >= 2),
            "a key shorter than its group"
        );
        assert!(
            batch.windows(2).all(|w| w[0].0 < w[1].0),
            "keys out of order"
        );
    }
    let writes: Vec<SegmentWrite<'_>> = blocks
        .iter()
        .flat_map(|(state, batch)| {
            batch
                .iter()
                .map(move |(key, value)| (state.as_str(), key.as_ref(), value.as_deref()))
        })
        .collect();
    // Byte for byte: the decoder accepts only the encoder's one form, so decoding
    // the re-encoded segment again could only give back `blocks`.
    assert_eq!(
        encode_segment(&writes),
        sealed,
        "a decoded segment re-encodes to other bytes"
    );
});
