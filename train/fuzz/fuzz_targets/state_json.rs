//! The trainer's `statekit_state.json` on arbitrary bytes, parsed and checked as `--resume`
//! does: never a panic, a hang or an unbounded allocation, and an accepted state is accepted
//! again once written back.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    train::fuzz::state_json(data);
});
