//! Megatron's `latest_checkpointed_iteration.txt` on arbitrary bytes: an iteration, `release`, or a
//! one-line refusal.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::megatron_tracker(data);
});
