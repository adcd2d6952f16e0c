//! Writes the seed inputs of the fuzz target in `train/fuzz/` into OUT_DIR (`train/fuzz/run.sh`
//! runs it, built without the `trainer` feature: no libtorch).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::args_os().nth(1).ok_or("usage: fuzz_seeds OUT_DIR")?);
    std::fs::create_dir_all(&out)?;
    for (name, bytes) in train::fuzz::state_json_seeds() {
        std::fs::write(out.join(name), bytes)?;
    }
    Ok(())
}
