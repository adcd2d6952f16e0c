//! A Megatron save's pickled state (`common_state`, a rank file's `args` with its enums) read as
//! the reader reads it, then summarized: never a panic, a hang or an unbounded allocation.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::megatron_saved_state(data);
});
