//! Writes seed inputs of the fuzz targets in `dataload/fuzz/`; `dataload/fuzz/run.sh` runs it.
//!
//! * `fuzz_seeds lines OUT_DIR FILE...`: for each JSON-lines file, the file with the index
//!   this crate builds for it, in the `line_index` target's input format.
//! * `fuzz_seeds states OUT_DIR`: loader states as `ShardedSampler::state_dict` writes them,
//!   across the sampler, sharding and position settings, mixtures among them, for the
//!   `loader_state` and `data_state` targets.
//! * `fuzz_seeds mixtures OUT_DIR`: mixture definitions (`ckpt data state --mixture` files):
//!   repeated and `once` sources, weight changes, for the `mixture_spec` target.

use std::path::PathBuf;

use dataload::{DataLoaderConfiguration, ShardedSampler};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: fuzz_seeds lines OUT_DIR FILE... | fuzz_seeds states|mixtures OUT_DIR";
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
            // Loaders reading a mixture, part way into it.
            for (name, spec) in mixtures() {
                let len = dataload::Mixture::new(spec.clone())?.len();
                let mut l =
                    ShardedSampler::builder().dataset_len(len).batch_size(4).world_size(3).mixture(spec).build()?;
                for _ in 0..5 {
                    l.next_batch()?;
                }
                std::fs::write(out.join(format!("mixture_{name}.json")), l.state_dict().to_json()?)?;
            }
        }
        Some("mixtures") => {
            for (name, spec) in mixtures() {
                std::fs::write(out.join(format!("{name}.json")), serde_json::to_string_pretty(&spec)?)?;
            }
        }
        _ => return Err(usage.into()),
    }
    Ok(())
}

/// Mixture definitions of each kind: sources that repeat, sources read once (the mixture's
/// length theirs), a curriculum of weight changes, and the one `ckpt data state` is tested on.
fn mixtures() -> Vec<(&'static str, dataload::MixtureSpec)> {
    let spec = |sizes: &[u64], weights: &[f64], once: &[usize], length: Option<u64>| dataload::MixtureSpec {
        sizes: sizes.to_vec(),
        weights: weights.to_vec(),
        seed: 3,
        once: once.to_vec(),
        length,
        changes: Vec::new(),
    };
    let curriculum = dataload::MixtureSpec {
        changes: vec![
            dataload::WeightChange { at: 100, weights: vec![0.1, 0.9] },
            dataload::WeightChange { at: 300, weights: vec![1.0, 1.0] },
        ],
        ..spec(&[50, 70], &[0.5, 0.5], &[], Some(500))
    };
    vec![
        ("repeat", spec(&[10, 30, 7], &[1.0, 2.0, 0.5], &[], Some(200))),
        ("once", spec(&[1000, 200, 5000], &[0.6, 0.3, 0.1], &[1], Some(4000))),
        ("all_once", spec(&[13, 29], &[1.0, 3.0], &[0, 1], None)),
        ("curriculum", curriculum),
    ]
}
