//! The store contract against a real SFTP server (OpenSSH's sshd on loopback, key
//! logins only) through OpenDAL's SFTP service: the seed's "backup host over SSH".
//! One test owns the server (it listens on a fixed port) and runs every contract case
//! in turn.
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

use std::time::Instant;

use support::sftp::SftpServer;
use support::{Backend, Env, SFTP, runtime};

macro_rules! run_on_sftp {
    ($($name:ident),* $(,)?) => {
        $(
            {
                let env = Env::new(Backend::Sftp);
                let started = Instant::now();
                runtime().block_on(cases::$name(&env));
                eprintln!("sftp: {} passed in {:.1} s", stringify!($name), started.elapsed().as_secs_f64());
            }
        )*
    };
}

#[test]
fn the_store_contract_holds_on_a_real_sftp_server() {
    let server = SftpServer::start();
    SFTP.set((server.user(), server.client_key(), server.data_dir()))
        .unwrap();
    contract_cases!(run_on_sftp);
}
