//! A byte progress bar on stderr, drawn only when stderr is a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct Bar(ProgressBar);

impl Bar {
    pub fn new(total: u64, enabled: bool) -> Bar {
        // indicatif hides itself when stderr is not a terminal.
        let target = if enabled { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
        let bar = ProgressBar::with_draw_target(Some(total), target);
        if let Ok(style) = ProgressStyle::with_template(
            "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        ) {
            bar.set_style(style);
        }
        Bar(bar)
    }

    pub fn set_total(&self, total: u64) {
        self.0.set_length(total);
    }

    pub fn inc(&self, n: u64) {
        self.0.inc(n);
    }

    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// Runs `f` with a progress report for `hf://` downloads: one bar over every file fetched,
/// shown from the first byte and cleared when `f` returns.
pub fn downloading<T>(quiet: bool, f: impl FnOnce(Option<ckpt::DownloadProgress>) -> T) -> T {
    let bar = std::sync::Arc::new(Bar::new(0, !quiet));
    let report = {
        let bar = bar.clone();
        move |n: u64, total: u64| {
            bar.set_total(total);
            bar.inc(n);
        }
    };
    let out = f(Some(ckpt::DownloadProgress(std::sync::Arc::new(report))));
    bar.finish();
    out
}
