//! Megatron's `metadata.json` on arbitrary bytes: `torch_dist` or not, or a one-line refusal.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::megatron_config(data);
});
