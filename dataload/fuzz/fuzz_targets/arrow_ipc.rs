//! An Arrow IPC file or stream on arbitrary bytes: its footer, the blocks it lists and the
//! message headers they point at (offsets, lengths, counts) are checked before arrow decodes
//! them, then every record batch is read. Refused or read, never a panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dataload::fuzz::arrow_ipc(data);
});
