//! Writes seed inputs of the fuzz targets in `dataload/fuzz/`; `dataload/fuzz/run.sh` runs it.
//!
//! * `fuzz_seeds lines OUT_DIR FILE...`: for each JSON-lines file, the file with the index
//!   this crate builds for it, in the `line_index` target's input format.
//! * `fuzz_seeds states OUT_DIR`: loader states as `ShardedSampler::state_dict` writes them,
//!   across the sampler, sharding and position settings, for the `loader_state` target.

use std::path::PathBuf;

use dataload::{DataLoaderConfiguration, ShardedSampler};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: fuzz_seeds lines OUT_DIR FILE... | fuzz_seeds states OUT_DIR";
    let mut args = std::env::args_os().skip(1);
    let mode = args.next().ok_or(usage)?;
    let out = PathBuf::from(args.next().ok_or(usage)?);
    std::fs::create_dir_all(&out)?;
    match mode.to_str() {
        Some("lines") => {
            for file in args.map(PathBuf::from) {
                let data = std::fs::read(&file)?;
                let zstd = file.extension().is_some_and(|e| e == "zst");
                // A file that does not index (a hostile fixture) is still a seed: as data alone.
                let seed = dataload::fuzz::line_index_seed(&data, zstd).unwrap_or_else(|| {
                    let len = u16::try_from(data.len()).unwrap_or(u16::MAX);
                    [&[u8::from(zstd)][..], &len.to_le_bytes(), &data[..usize::from(len)]].concat()
                });
                std::fs::write(out.join(file.file_name().ok_or(usage)?), seed)?;
            }
        }
        Some("states") => {
            let seeded = |seed| DataLoaderConfiguration {
                use_seedable_sampler: true,
                data_seed: Some(seed),
                ..DataLoaderConfiguration::default()
            };
            let cases = [
                ("sequential", 100, 4, 2, false, DataLoaderConfiguration::default(), 0),
                ("shuffled", 100, 4, 2, true, seeded(-3), 3),
                ("max_seed", 10, 3, 1, true, seeded(dataload::MAX_SEED), 1),
                ("split", 37, 4, 2, false, DataLoaderConfiguration { split_batches: true, ..seeded(7) }, 2),
                ("uneven", 37, 5, 3, false, DataLoaderConfiguration { even_batches: false, ..seeded(7) }, 2),
                ("dispatch", 50, 4, 2, false, DataLoaderConfiguration { dispatch_batches: Some(true), ..seeded(1) }, 4),
            ];
            for (name, n, bs, world, shuffle, config, steps) in cases {
                let mut l = ShardedSampler::builder()
                    .dataset_len(n)
                    .batch_size(bs)
                    .world_size(world)
                    .shuffle(shuffle || config.use_seedable_sampler)
                    .config(config)
                    .fingerprint(format!("fixture:{name}"))
                    .build()?;
                // Epoch 1, except where the seed leaves no room for `seed + epoch`.
                l.set_epoch(u64::from(name != "max_seed"));
                for _ in 0..steps {
                    l.next_batch()?;
                }
                std::fs::write(out.join(format!("{name}.json")), l.state_dict().to_json()?)?;
            }
        }
        _ => return Err(usage.into()),
    }
    Ok(())
}
