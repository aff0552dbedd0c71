//! Fuzz target: the frame decoder, incremental and exact, on arbitrary bytes.
//!
//! Properties checked beyond "no panic": the decoder never asks for more than its
//! maximum frame, consumes only whole frames, and whatever it decodes re-encodes to
//! the very bytes it came from.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use stillpoint_wire::{FrameDecoder, HEADER_LEN, encode_to_bytes};

const MAX_PAYLOAD: u32 = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    let decoder = FrameDecoder::new(MAX_PAYLOAD);
    assert!(decoder.bytes_needed(data) <= HEADER_LEN + MAX_PAYLOAD as usize);

    // Incremental: feed the input in two pieces split by its first byte.
    let split = data.first().map_or(0, |b| usize::from(*b)).min(data.len());
    let mut buf = BytesMut::from(&data[..split]);
    let mut fed = split;
    loop {
        let before = buf.clone();
        match decoder.decode(&mut buf) {
            Ok(Some(message)) => {
                let consumed = before.len() - buf.len();
                let reencoded = encode_to_bytes(&message).expect("a decoded message re-encodes");
                assert_eq!(&reencoded[..], &before[..consumed], "decode/encode disagree");
            }
            Ok(None) if fed < data.len() => {
                buf.extend_from_slice(&data[fed..]);
                fed = data.len();
            }
            Ok(None) | Err(_) => break,
        }
    }

    // Exact: one frame, nothing more.
    if let Ok(message) = decoder.decode_exact(Bytes::copy_from_slice(data)) {
        assert_eq!(&encode_to_bytes(&message).expect("re-encodes")[..], data);
    }
});
