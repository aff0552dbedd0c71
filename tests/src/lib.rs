//! End-to-end tests of the stillpoint workspace live in `tests/`; this library is empty.
