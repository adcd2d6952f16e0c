//! An Arrow IPC file or stream on arbitrary bytes: its footer, the blocks it lists and the
//! message headers they point at (offsets, lengths, counts) are checked before arrow decodes
//! them, then every record batch is read. Refused or read, never a panic.
//!
//! One kind of panic is not a finding: one raised inside arrow's own crates, which the reader
//! catches around arrow's decoder (`arrow_file::unpanicked`) and returns as an error naming the
//! file. Our checks do not foresee every malformed buffer (a found one: an offsets buffer whose
//! length is not a multiple of 4, which arrow's validation asserts on); the test
//! `a_panic_inside_arrows_decoder_is_an_error` in `dataload/tests/sources/hostile.rs` pins that
//! case. libFuzzer's hook, which aborts, still sees every other panic.
#![no_main]

use std::sync::Once;

static HOOK: Once = Once::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    HOOK.call_once(|| {
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let in_arrow = info.location().is_some_and(|l| l.file().contains("/arrow-"));
            if !in_arrow {
                abort(info);
            }
        }));
    });
    dataload::fuzz::arrow_ipc(data);
});
