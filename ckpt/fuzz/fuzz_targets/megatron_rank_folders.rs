//! The names of a legacy Megatron iteration folder (one per line): a whole grid of rank folders,
//! each at the place its name gives, or a one-line refusal; never a loop or an allocation sized
//! by a rank in a name.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::megatron_rank_folders(data);
});
