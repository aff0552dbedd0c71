//! End-to-end tests of the stillpoint workspace live in `tests/`; this library is empty.

/// `docs/engine.md`'s Rust example, compiled and run with the doctests so it stays
/// true.
#[doc = include_str!("../../docs/engine.md")]
#[cfg(doctest)]
pub struct EngineDoc;
