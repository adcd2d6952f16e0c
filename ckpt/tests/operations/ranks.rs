//! One operation over the ranks of a job, with threads as ranks (`collective`'s in-process
//! group): the library's side of what the `mpirun` tests check with the binary. The output is
//! byte for byte one process's, every rank's share is recorded, rank 0 sees the whole job's
//! progress, and a rank that fails leaves the destination as it was.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ckpt::{Checkpoint, Job, MergeOptions, Outcome, WriteOptions};
use collective::{Collective, InProcessGroup};

/// A safetensors source of `count` tensors of `floats` f32 each, written by the `safetensors`
/// crate.
fn source(path: &Path, count: usize, floats: usize) {
    let datas: Vec<Vec<u8>> = (0..count)
        .map(|i| (0..floats as u32).flat_map(|j| (j.wrapping_mul(2654435761) ^ i as u32).to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (format!("t{i}"), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![floats], d).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    if root.is_file() {
        out.insert(PathBuf::new(), std::fs::read(root).unwrap());
        return out;
    }
    for e in std::fs::read_dir(root).unwrap() {
        let p = e.unwrap().path();
        out.insert(p.strip_prefix(root).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
    }
    out
}

type Op<'a> = dyn Fn(&Checkpoint, &WriteOptions<'_>) -> ckpt::Result<Outcome> + Sync + 'a;

/// Runs `op` on `n` threads as the ranks of one job, rank `r` reading `src` (or its own copy
/// `src.r` where there is one); returns each rank's result and what rank 0's progress callback
/// was told.
fn on_ranks(n: u64, src: &Path, op: &Op<'_>) -> (Vec<ckpt::Result<Outcome>>, u64) {
    let progress = AtomicU64::new(0);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = InProcessGroup::new(n)
            .into_iter()
            .map(|comm| {
                let progress = &progress;
                s.spawn(move || {
                    let own = src.with_extension(format!("{}", comm.rank()));
                    let src = if own.exists() { own } else { src.to_path_buf() };
                    let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
                    let job = Job::new(&comm);
                    let count = |b: u64| {
                        progress.fetch_add(b, Ordering::Relaxed);
                    };
                    let rank0 = job.rank() == 0;
                    let opts = WriteOptions {
                        job: Some(&job),
                        progress: if rank0 { Some(&count) } else { None },
                        ..WriteOptions::default()
                    };
                    op(&ck, &opts)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (results, progress.into_inner())
}

#[test]
fn threads_as_ranks_write_one_process_bytes_and_report_their_shares() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src.safetensors");
    source(&src, 20, 50_000);
    let out = tmp.path().join("out");
    let ops: Vec<(&str, Box<Op<'_>>)> = vec![
        ("split", Box::new(|ck, o| ckpt::split(ck, &out, 900_000, o))),
        ("merge", Box::new(|ck, o| ckpt::merge(ck, &out.join("m.safetensors"), &MergeOptions::default(), o))),
    ];
    for (name, op) in &ops {
        let _ = std::fs::remove_dir_all(&out);
        let one = op(&Checkpoint::open(src.to_str().unwrap()).unwrap(), &WriteOptions::default()).unwrap();
        let want = tree(&out);
        for n in 1..=5 {
            std::fs::remove_dir_all(&out).unwrap();
            let (results, progress) = on_ranks(n, &src, op.as_ref());
            let outcomes: Vec<Outcome> = results.into_iter().map(Result::unwrap).collect();
            assert_eq!(tree(&out), want, "{name} on {n} ranks");
            for o in &outcomes {
                assert_eq!(o.files, one.files, "{name}: every rank returns the outcome");
                assert_eq!(o.ranks.len() as u64, n);
            }
            let written: u64 = outcomes[0].ranks.iter().map(|r| r.bytes_written).sum();
            // Every byte of the data files once (the index is rank 0's commit, not a share).
            let data = |p: &PathBuf| p.as_os_str().is_empty() || p.extension().is_some_and(|e| e == "safetensors");
            let on_disk: u64 = want.iter().filter(|(p, _)| data(p)).map(|(_, b)| b.len() as u64).sum();
            assert_eq!(written, on_disk, "{name} on {n} ranks: the shares add up to the files");
            // Rank 0's bar follows every rank's bytes, not its own only.
            assert!(progress >= one.bytes * 9 / 10, "{name} on {n} ranks: progress {progress} of {}", one.bytes);
        }
    }
}

#[test]
fn a_failing_rank_leaves_the_destination_as_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src.safetensors");
    source(&src, 8, 40_000);
    let out = tmp.path().join("out");
    // The previous output.
    ckpt::split(&Checkpoint::open(src.to_str().unwrap()).unwrap(), &out, 500_000, &WriteOptions::default()).unwrap();
    let before = tree(&out);
    // Each rank reads its own copy of the source; rank 2's is cut short after it was opened, so
    // rank 2 alone fails, while copying.
    for r in 0..3 {
        std::fs::copy(&src, src.with_extension(r.to_string())).unwrap();
    }
    let op = |ck: &Checkpoint, o: &WriteOptions<'_>| {
        if o.job.is_some_and(|j| j.rank() == 2) {
            let f = std::fs::OpenOptions::new().write(true).open(ck.files()[0].path.clone()).unwrap();
            f.set_len(1000).unwrap();
        }
        ckpt::split(ck, &out, 200_000, o)
    };
    let (results, _) = on_ranks(3, &src, &op);
    let errors: Vec<String> = results.iter().filter_map(|r| r.as_ref().err()).map(ToString::to_string).collect();
    assert_eq!(errors.len(), 3, "every rank fails: {errors:?}");
    assert!(errors[2].contains("src.2"), "rank 2 reports what it saw: {}", errors[2]);
    for e in &errors[..2] {
        assert!(e.starts_with("rank 2 failed"), "the others name it: {e}");
    }
    assert_eq!(tree(&out), before, "the previous output is untouched, and no temporary is left");
}

#[test]
fn a_rank_failing_alone_before_the_others_hear_from_it_ends_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src.safetensors");
    source(&src, 8, 40_000);
    let out = tmp.path().join("merged.safetensors");
    std::fs::write(&out, b"the previous output").unwrap();
    // Rank 1 reads its own copy of the source, gone once it was opened (an I/O error on one
    // node): rank 1 fails as it opens its files for the copy, before it meets the others, who
    // have gone on into the protocol.
    std::fs::copy(&src, src.with_extension("1")).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let (src2, out2) = (src.clone(), out.clone());
    std::thread::spawn(move || {
        let op = move |ck: &Checkpoint, o: &WriteOptions<'_>| {
            if o.job.is_some_and(|j| j.rank() == 1) {
                std::fs::remove_file(&ck.files()[0].path).unwrap();
            }
            ckpt::merge(ck, &out2, &MergeOptions::default(), o)
        };
        let _ = tx.send(on_ranks(3, &src2, &op).0);
    });
    let results = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("no rank waits for rank 1 forever");
    let errors: Vec<String> = results.iter().filter_map(|r| r.as_ref().err()).map(ToString::to_string).collect();
    assert_eq!(errors.len(), 3, "every rank fails: {errors:?}");
    assert!(errors[1].contains("src.1"), "rank 1 reports what it saw: {}", errors[1]);
    for r in [0, 2] {
        assert!(errors[r].starts_with("rank 1 failed"), "the others name it: {}", errors[r]);
    }
    let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "no temporary left: {names:?}");
    assert_eq!(std::fs::read(&out).unwrap(), b"the previous output");
}
