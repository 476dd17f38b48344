//! `csi-driver client`: calls CSI RPCs on any socket and prints the answer.

use std::process::ExitCode;

use clap::{Args, Subcommand};

#[derive(Debug, Args)]
pub struct ClientArgs {
    #[command(subcommand)]
    pub call: Call,
}

#[derive(Debug, Subcommand)]
pub enum Call {
    /// GetPluginInfo and Probe.
    Info,
}

pub fn main(_endpoint: &str, _args: &ClientArgs) -> ExitCode {
    eprintln!("csi-driver client: not available in this build");
    ExitCode::from(2)
}
