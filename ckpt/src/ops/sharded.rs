//! Saving a DCP folder from the ranks of a running job, each from its own memory.
//!
//! [`save_sharded`] is what a training loop calls at a checkpoint (and what the Python bindings
//! expose): every rank passes the tensors it holds, each a dim-0 slice of a global tensor (a
//! whole tensor is the slice at row 0 with every row), and the non-tensor values it owns. Nothing
//! is gathered onto one rank but the small descriptors.
//!
//! # Protocol
//!
//! It is one operation of a [`crate::Job`] over the ranks, written by the plan executor and its
//! stage like every other output. The destination is claimed first (the ranks agree on it, and
//! rank 0 holds its lock until the commit); then
//!
//! 1. every rank lays out its own file, rank 0 having refused a `dir` that exists, and the ranks
//!    agree that all of them managed;
//! 2. every rank tells the others its file's length and its items' descriptors, and builds the
//!    same plan from all of them: one target per rank file, written by that rank alone from its
//!    own buffers, and `.metadata` as the trailer, the commit marker torch reads (the layout is
//!    the DCP format's, see its `save` module);
//! 3. the executor runs the plan: the new folder staged beside `dir`, each rank's file created,
//!    filled, sealed with torch's CRCs and made durable by its rank, then rank 0 renames the
//!    files into place, writes `.metadata` last and renames the staged folder to `dir`; all
//!    ranks return only once it is committed.
//!
//! A kill at any moment leaves either no `dir` or a complete one; a leftover temporary folder
//! has a name no reader takes for a checkpoint. `dir` must not exist yet.
//!
//! # Errors, the same on every rank
//!
//! A failure anywhere ends the save everywhere (a rank failing alone is heard by the others in
//! their next exchange, as in every operation of a job), and every rank returns the same
//! [`Error::ShardedSave`], naming the rank it blames: the rank that saw the error holds the
//! error itself, every other rank what that rank reported of it ([`Error::Reported`]: its kind,
//! its variant's name and its message). So the error of every rank has the same kind and text,
//! and a training loop's ranks all raise the same exception.

use std::path::Path;

use collective::Collective;
use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::formats::{lay_out_sharded_rank as lay_out_rank, plan_sharded_folder as plan_folder};
use crate::ops::local::{KeyPart, LocalTensor, LocalValue};
use crate::ops::outcome::Outcome;
use crate::write::job::{agree, Job};
use crate::write::WriteOptions;

/// Saves this rank's `tensors` and `values` into the DCP folder `dir`, with every other rank of
/// `comm` doing the same; returns once `dir` is committed (see the module docs). Every rank
/// must call it, with the same `dir`. `values` should come from one rank only (any one).
pub fn save_sharded(
    dir: &Path,
    tensors: &[LocalTensor<'_>],
    values: &[(Vec<KeyPart>, LocalValue)],
    comm: &dyn Collective,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let job = Job::new(comm);
    let opts = WriteOptions {
        job: Some(&job),
        copy: opts.copy,
        checksums: opts.checksums,
        progress: opts.progress,
        allow_expanded: opts.allow_expanded,
    };
    job.operation(dir, || save_here(dir, tensors, values, &job, &opts)).map_err(|e| same_on_every_rank(comm, dir, e))
}

fn save_here(
    dir: &Path,
    tensors: &[LocalTensor<'_>],
    values: &[(Vec<KeyPart>, LocalValue)],
    job: &Job<'_>,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let _held = crate::write::claim::claim(dir, opts)?;
    let rank = job.rank();
    let existing = match rank {
        0 => refuse_existing(dir),
        _ => Ok(()),
    };
    let laid = agree(job, dir, existing.and_then(|()| lay_out_rank(dir, rank, tensors, values)))?;
    let gathered = job.exchange(dir, laid.said())?;
    let folder = plan_folder(dir, laid, &gathered)?;
    crate::write::execute::execute_from(&folder.plan, &folder.sources, &[], opts)?;
    Ok(folder.outcome)
}

/// Refuses a `dir` that exists: a sharded save makes a new folder.
fn refuse_existing(dir: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dir) {
        Ok(_) => Err(Error::OutputExists { path: dir.to_path_buf(), appeared: false }),
        Err(_) => Ok(()),
    }
}

/// What the rank holding the error tells the others of it.
#[derive(Serialize, Deserialize)]
struct Note {
    /// The rank the error blames.
    rank: u64,
    kind: String,
    variant: String,
    message: String,
}

/// The save failed on every rank (a job's operation ends the same way on all of them): each
/// rank's error, made the same everywhere (see the module docs). `e` is this rank's own error,
/// or [`Error::OtherRank`] where another rank's failure ended its part; the lowest rank that
/// holds its own error tells the others of it.
fn same_on_every_rank(comm: &dyn Collective, dir: &Path, e: Error) -> Error {
    let mine = match e {
        Error::OtherRank { rank } => Err(rank),
        e @ Error::ShardedSave { .. } => Ok(e),
        e => Ok(Error::ShardedSave { dir: dir.to_path_buf(), rank: comm.rank(), source: Box::new(e) }),
    };
    if comm.world_size() == 1 {
        return mine.unwrap_or_else(|rank| Error::OtherRank { rank });
    }
    let note = match &mine {
        Ok(Error::ShardedSave { rank, source, .. }) => serde_json::to_vec(&Note {
            rank: *rank,
            kind: kind_name(source.kind()).into(),
            variant: variant_of(source).into(),
            message: source.to_string(),
        })
        .unwrap_or_default(),
        _ => Vec::new(),
    };
    let all = match comm.all_gather(note) {
        Ok(all) => all,
        Err(source) => return mine.unwrap_or_else(|_| Error::Collective { dir: dir.to_path_buf(), source }),
    };
    let first = all.iter().enumerate().find(|(_, n)| !n.is_empty());
    match (first, mine) {
        (Some((r, _)), Ok(e)) if r as u64 == comm.rank() => e,
        (Some((_, note)), mine) => match serde_json::from_slice::<Note>(note) {
            Ok(n) => Error::ShardedSave {
                dir: dir.to_path_buf(),
                rank: n.rank,
                source: Box::new(Error::Reported { kind: kind_named(&n.kind), variant: n.variant, message: n.message }),
            },
            Err(_) => mine.unwrap_or_else(|rank| Error::OtherRank { rank }),
        },
        (None, mine) => mine.unwrap_or_else(|rank| Error::OtherRank { rank }),
    }
}

/// The name of an error's variant, as a rank reports it (a reported error keeps the name of
/// the error it reports).
fn variant_of(e: &Error) -> &str {
    match e {
        Error::Reported { variant, .. } => variant,
        e => e.variant_name(),
    }
}

/// An [`ErrorKind`] as it crosses between ranks.
fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidData => "InvalidData",
        ErrorKind::NotFound => "NotFound",
        ErrorKind::Usage => "Usage",
        ErrorKind::Io => "Io",
        ErrorKind::Collective => "Collective",
    }
}

/// The [`ErrorKind`] [`kind_name`] named (a name this build does not know is an error of the
/// ranks' collective work).
fn kind_named(name: &str) -> ErrorKind {
    [ErrorKind::InvalidData, ErrorKind::NotFound, ErrorKind::Usage, ErrorKind::Io]
        .into_iter()
        .find(|k| kind_name(*k) == name)
        .unwrap_or(ErrorKind::Collective)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read::dtype::Dtype;
    use collective::InProcessGroup;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn key(parts: &[&str]) -> Vec<KeyPart> {
        parts.iter().map(|p| KeyPart::Key(p.to_string())).collect()
    }

    /// Each rank of `world` saves FSDP2's dim-0 chunk of a 5×3 tensor and a whole 0-d one.
    fn save(dir: &Path, world: u64, overlap: bool) -> Vec<Result<Outcome>> {
        let full: Vec<f32> = (0..15).map(|i| i as f32).collect();
        let handles = InProcessGroup::new(world);
        std::thread::scope(|s| {
            let joins: Vec<_> = handles
                .into_iter()
                .map(|comm| {
                    let full = &full;
                    s.spawn(move || {
                        let r = comm.rank();
                        let mut rows = fsdp_state::chunk_rows(5, world, r).unwrap_or(0..0);
                        if overlap && r == 1 {
                            rows.start -= 1;
                        }
                        let bytes = f32_bytes(&full[rows.start as usize * 3..rows.end as usize * 3]);
                        let step = f32_bytes(&[7.0]);
                        let mut tensors = vec![LocalTensor {
                            path: key(&["model", "w"]),
                            dtype: Dtype::F32,
                            global_shape: vec![5, 3],
                            dim0_offset: rows.start,
                            bytes: &bytes,
                        }];
                        let mut values = Vec::new();
                        if r == 0 {
                            tensors.push(LocalTensor {
                                path: key(&["model", "step"]),
                                dtype: Dtype::F32,
                                global_shape: vec![],
                                dim0_offset: 0,
                                bytes: &step,
                            });
                            values.push((key(&["model", "lr"]), LocalValue::Float(0.5)));
                        }
                        save_sharded(dir, &tensors, &values, &comm, &WriteOptions::default())
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn ranks_write_a_folder_that_merges_back() {
        for world in [1, 2, 3, 4] {
            let tmp = tempfile::tempdir().expect("tempdir");
            let dir = tmp.path().join("pytorch_model_fsdp_0");
            for out in save(&dir, world, false) {
                let out = out.expect("save");
                assert_eq!(out.tensors, 2);
                assert_eq!(out.values, vec!["model.lr".to_string()]);
            }
            let ck = crate::Checkpoint::open(&dir.to_string_lossy()).expect("open");
            // A rank that holds no rows (the 4th of 4 for 5 rows) writes an empty file that
            // the metadata never names, so the catalog counts the files that hold data.
            assert_eq!(ck.world_size(), Some(world.min(3)));
            let report = crate::verify(&dir.to_string_lossy()).expect("verify");
            assert!(report.problems.is_empty(), "{:?}", report.problems);
            let merged = tmp.path().join("m.safetensors");
            crate::merge(&ck, &merged, &Default::default(), &Default::default()).expect("merge");
            let bytes = std::fs::read(&merged).expect("read");
            let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
            let w = st.tensor("w").expect("w");
            assert_eq!(w.shape(), &[5, 3]);
            assert_eq!(w.data(), &f32_bytes(&(0..15).map(|i| i as f32).collect::<Vec<_>>())[..]);
            assert_eq!(st.tensor("step").expect("step").data(), &f32_bytes(&[7.0])[..]);
            // A rank's rows alone, across the rank files' boundaries.
            let t = ck.tensors().iter().find(|t| t.name == "w").expect("w");
            let rows = ck.read_tensor_range(t, 2 * 12..4 * 12).expect("range");
            assert_eq!(rows, f32_bytes(&(6..12).map(|i| i as f32).collect::<Vec<_>>()));
            // Nothing but the committed folder is left.
            let names: Vec<_> = std::fs::read_dir(tmp.path()).expect("ls").map(|e| e.expect("e").file_name()).collect();
            assert_eq!(names.len(), 2, "{names:?}");
        }
    }

    #[test]
    fn a_save_state_folder_opens_as_its_model() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("pytorch_model_fsdp_0");
        for out in save(&dir, 2, false) {
            out.expect("save");
        }
        let ck = crate::Checkpoint::open(&tmp.path().to_string_lossy()).expect("open");
        assert_eq!(ck.format(), crate::Format::AccelerateState);
        assert_eq!(ck.save_state().expect("components").models[0].path, dir);
        assert_eq!(ck.tensors().len(), 2);
    }

    #[test]
    fn an_optimizer_folder_without_param_groups_is_refused_by_name() {
        let tmp = tempfile::tempdir().expect("tempdir");
        for sub in ["pytorch_model_fsdp_0", "optimizer_0"] {
            for out in save(&tmp.path().join("state").join(sub), 2, false) {
                out.expect("save");
            }
        }
        let e = crate::Checkpoint::open(&tmp.path().join("state").to_string_lossy()).expect_err("no param_groups");
        let e = e.to_string();
        assert!(e.contains("optimizer_0") && e.contains("param_groups"), "{e}");
    }

    #[test]
    fn overlapping_rows_fail_on_every_rank_and_leave_nothing() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("d");
        let want = format!(
            "sharded save failed on rank 1: cannot save {}: tensor `model.w` has rows 2..3 on two ranks",
            dir.display()
        );
        for out in save(&dir, 2, true) {
            let e = out.expect_err("overlap");
            assert_eq!(e.to_string(), want);
            assert!(matches!(e, Error::ShardedSave { rank: 1, .. }), "{e:?}");
            assert_eq!(e.kind(), ErrorKind::Usage);
        }
        assert_eq!(std::fs::read_dir(tmp.path()).expect("ls").count(), 0);
    }

    #[test]
    fn an_existing_folder_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("d");
        std::fs::create_dir(&dir).expect("mkdir");
        for out in save(&dir, 2, false) {
            let e = out.expect_err("exists").to_string();
            assert!(e.contains("already exists; refusing to write over it"), "{e}");
        }
    }

    /// Rank `bad` of `world` passes a slice that is not whole rows; the others save well.
    fn save_with_a_bad_rank(dir: &Path, world: u64, bad: u64) -> Vec<Result<Outcome>> {
        let bytes = f32_bytes(&[1.0; 6]);
        std::thread::scope(|s| {
            let joins: Vec<_> = InProcessGroup::new(world)
                .into_iter()
                .map(|comm| {
                    let bytes = &bytes;
                    s.spawn(move || {
                        let r = comm.rank();
                        let len = if r == bad { 5 } else { 6 } * 4;
                        let t = LocalTensor {
                            path: key(&["model", &format!("w{r}")]),
                            dtype: Dtype::F32,
                            global_shape: vec![2, 3],
                            dim0_offset: 0,
                            bytes: &bytes[..len],
                        };
                        save_sharded(dir, &[t], &[], &comm, &WriteOptions::default())
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn a_rank_failing_alone_makes_every_rank_return_its_error_with_its_kind() {
        for (world, bad) in [(2, 1), (3, 1), (3, 0), (4, 3)] {
            let tmp = tempfile::tempdir().expect("tempdir");
            let dir = tmp.path().join("d");
            let errors: Vec<Error> =
                save_with_a_bad_rank(&dir, world, bad).into_iter().map(|r| r.expect_err("bad rank")).collect();
            let want = format!(
                "sharded save failed on rank {bad}: cannot save {}: tensor `model.w{bad}` has 20 bytes, not whole \
                 rows of 12 bytes",
                dir.join(format!("__{bad}_0.distcp")).display()
            );
            for (r, e) in errors.iter().enumerate() {
                assert_eq!(e.to_string(), want, "rank {r} of {world}");
                assert_eq!(e.kind(), ErrorKind::Usage, "rank {r} of {world}");
                let Error::ShardedSave { rank, source, .. } = e else { panic!("rank {r}: {e:?}") };
                assert_eq!(*rank, bad);
                // The rank that saw it keeps the error itself; the others have its report.
                match r as u64 == bad {
                    true => assert!(matches!(**source, Error::BadSaveTensor { .. }), "{source:?}"),
                    false => assert!(
                        matches!(&**source, Error::Reported { variant, .. } if variant == "BadSaveTensor"),
                        "{source:?}"
                    ),
                }
            }
            assert_eq!(std::fs::read_dir(tmp.path()).expect("ls").count(), 0, "nothing left, no lock");
        }
    }

    #[test]
    fn a_refused_destination_is_the_same_error_on_every_rank() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("d");
        std::fs::create_dir(&dir).expect("mkdir");
        let errors: Vec<Error> = save(&dir, 3, false).into_iter().map(|r| r.expect_err("exists")).collect();
        for e in &errors {
            assert_eq!(e.to_string(), errors[0].to_string());
            assert_eq!(e.kind(), ErrorKind::Usage);
            assert!(matches!(e, Error::ShardedSave { rank: 0, .. }), "{e:?}");
        }
    }
}
