//! `statekit-train`: a small transformer trained by MPI ranks, checkpointed through `ckpt` in
//! accelerate's FSDP2 `save_state` layout, fed by `dataload`, resumable to the same bits.
//!
//! Rank 0 prints one JSON line per step on stdout
//! (`{"step":..,"loss":..,"lr":..,"tokens":..,"elapsed_s":..}`); progress goes to stderr.
//! Exit codes: 0 done (or saved and stopped on SIGTERM/SIGINT), 1 an error, 2 a usage error.

use train as trainer;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = match trainer::Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    match trainer::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<trainer::Refused>() => ExitCode::from(1),
        Err(e) => {
            // Errors quote names read from checkpoints: no control character reaches the terminal.
            eprintln!("statekit-train: error: {}", ckpt::escape_controls(&format!("{e:#}")));
            ExitCode::from(1)
        }
    }
}
