//! The store contract on `file://` and `memory://` (the S3 run is in `s3.rs`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;
#[macro_use]
#[path = "contract/cases.rs"]
mod cases;

macro_rules! on_backend {
    ($backend:ident: $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let env = crate::support::Env::new(crate::support::Backend::$backend);
                crate::support::runtime().block_on(crate::cases::$name(&env));
            }
        )*
    };
}

mod file {
    macro_rules! file_cases { ($($name:ident),* $(,)?) => { on_backend!(File: $($name),*); } }
    contract_cases!(file_cases);
}

mod memory {
    macro_rules! memory_cases { ($($name:ident),* $(,)?) => { on_backend!(Memory: $($name),*); } }
    contract_cases!(memory_cases);
}
