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
