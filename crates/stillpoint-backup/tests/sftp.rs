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

use support::SFTP;
use support::sftp::SftpServer;

macro_rules! run_on_sftp {
    ($($name:ident),* $(,)?) => { run_timed!(Sftp, "sftp": $($name),*) };
}

#[test]
fn the_store_contract_holds_on_a_real_sftp_server() {
    let server = SftpServer::start();
    SFTP.set((server.user(), server.client_key(), server.data_dir()))
        .unwrap();
    contract_cases!(run_on_sftp);
}
