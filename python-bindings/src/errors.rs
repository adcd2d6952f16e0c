//! Rust errors as Python exceptions.
//!
//! The classes live in the pure-Python `statekit.errors`, under a parent per enum
//! (`ckpt::Error`, `dataload::DataloadError`, `collective::CollectiveError`); this module
//! passes the enum, the variant, the message and the structured fields, and
//! `statekit.errors._from_native` builds the exception (an I/O error also subclasses the
//! matching `OSError`: `FileNotFoundError`, `PermissionError`, ...). A `ckpt` error's class is
//! chosen here from its `kind()`, so a new variant has a class the day it has a kind.

use pyo3::prelude::*;
use pyo3::types::PyDict;

fn io_kind(e: &std::io::Error) -> (&'static str, Option<i32>) {
    use std::io::ErrorKind as K;
    let kind = match e.kind() {
        K::NotFound => "NotFound",
        K::PermissionDenied => "PermissionDenied",
        K::AlreadyExists => "AlreadyExists",
        K::IsADirectory => "IsADirectory",
        K::NotADirectory => "NotADirectory",
        K::Interrupted => "Interrupted",
        K::TimedOut => "TimedOut",
        _ => "Other",
    };
    (kind, e.raw_os_error())
}

fn build(
    domain: &str,
    variant: String,
    message: String,
    fill: impl FnOnce(&Bound<'_, PyDict>) -> PyResult<()>,
) -> PyErr {
    Python::attach(|py| {
        let made = (|| -> PyResult<PyErr> {
            let fields = PyDict::new(py);
            fill(&fields)?;
            let errors = py.import("statekit.errors")?;
            let exc = errors.getattr("_from_native")?.call1((domain, variant.as_str(), message.as_str(), fields))?;
            Ok(PyErr::from_value(exc))
        })();
        made.unwrap_or_else(|e| e)
    })
}

/// A `ckpt` error raised by an operation that writes (its hints say what writes anyway).
pub(crate) fn ckpt(e: ckpt::Error) -> PyErr {
    ckpt_doing(e, ("writing", "writes"))
}

/// A `ckpt` error, its message worded for a Python caller: options by their keywords, and the
/// `hint:` of an option that would let the call through, in the words of `verb` (`("loading",
/// "loads")`).
pub(crate) fn ckpt_doing(e: ckpt::Error, verb: (&str, &str)) -> PyErr {
    let message = match &e {
        ckpt::Error::Misuse { misuse, .. } => misuse.describe(&keyword),
        ckpt::Error::ExpandedView { path, tensor, output, storage } => format!(
            "{}: tensor `{}` is a broadcast view: {doing} it takes {output} bytes from a {storage}-byte storage; \
             hint: `allow_expanded=True` {does} it anyway",
            ckpt::escape_controls(&path.display().to_string()),
            ckpt::escape_controls(tensor),
            doing = verb.0,
            does = verb.1,
        ),
        ckpt::Error::NotReshardable { .. } => format!(
            "{e}; hint: `statekit.ckpt.convert(src, out, to=\"dcp\", world_size=M)` lays any checkpoint out for M ranks"
        ),
        _ => e.to_string(),
    };
    // The library keeps the names it quotes as the file holds them; the message Python shows
    // escapes their control characters, so a tensor name cannot forge a line of a traceback.
    let message = ckpt::escape_controls(&message).into_owned();
    let variant = e.variant_name().to_owned();
    build("ckpt", variant, message, |d| {
        d.set_item("class", class_of(&e))?;
        match &e {
            ckpt::Error::Io { path, source } => {
                let (kind, errno) = io_kind(source);
                d.set_item("path", path.display().to_string())?;
                d.set_item("io_kind", kind)?;
                d.set_item("errno", errno)?;
            }
            ckpt::Error::RefusedGlobal { path, global } => {
                d.set_item("path", path.display().to_string())?;
                d.set_item("global_name", global)?;
                d.set_item("globals", vec![global.clone()])?;
            }
            ckpt::Error::GlobalNotAllowed { path, globals, .. } => {
                d.set_item("path", path.display().to_string())?;
                d.set_item("global_name", globals.first().cloned().unwrap_or_default())?;
                d.set_item("globals", globals.clone())?;
            }
            ckpt::Error::HubAuth { repo, file, status, .. } => {
                d.set_item("repo", repo)?;
                d.set_item("file", file)?;
                d.set_item("status", *status)?;
            }
            ckpt::Error::HubNotFound { repo, revision, file, .. } => {
                d.set_item("repo", repo)?;
                d.set_item("revision", revision)?;
                d.set_item("file", file.clone())?;
            }
            ckpt::Error::HubCorrupt { repo, file, .. } => {
                d.set_item("repo", repo)?;
                d.set_item("file", file)?;
            }
            ckpt::Error::Collective { source, .. } => {
                d.set_item("cause", source.to_string())?;
            }
            ckpt::Error::DestinationLocked { dst, lock, pid } => {
                d.set_item("path", dst.display().to_string())?;
                d.set_item("lock", lock.display().to_string())?;
                d.set_item("pid", *pid)?;
            }
            // The same fields on every rank: what failed is in `cause` (its variant) and in
            // the message, never as an `OSError` of one rank only.
            ckpt::Error::ShardedSave { dir, rank, source } => {
                d.set_item("sharded", true)?;
                d.set_item("path", dir.display().to_string())?;
                d.set_item("rank", *rank)?;
                let cause = match &**source {
                    ckpt::Error::Reported { variant, .. } => variant.as_str(),
                    e => e.variant_name(),
                };
                d.set_item("cause", cause)?;
            }
            ckpt::Error::DestinationsDiffer { dst, rank, other } => {
                d.set_item("path", dst.display().to_string())?;
                d.set_item("rank", *rank)?;
                d.set_item("other", other.display().to_string())?;
            }
            _ => {}
        }
        Ok(())
    })
}

/// The `statekit.errors` class of `e`: the class of its [`ckpt::ErrorKind`], or a subclass of
/// it for the errors a Python caller catches by name. A sharded save's failure is of the class
/// of what failed, on every rank (the rank that saw it holds the error, the others its report);
/// `_from_native` makes it a `ShardedSaveError` too.
fn class_of(e: &ckpt::Error) -> &'static str {
    match e {
        ckpt::Error::ShardedSave { source, .. } => class_of(source),
        ckpt::Error::Reported { variant, kind, .. } => class_named(variant, *kind),
        e => class_named(e.variant_name(), e.kind()),
    }
}

/// The class of an error of the variant named `variant` and of `kind`.
fn class_named(variant: &str, kind: ckpt::ErrorKind) -> &'static str {
    use ckpt::ErrorKind as K;
    match variant {
        "RefusedGlobal" | "GlobalNotAllowed" => "UnsafePickle",
        "BadPickle" => "BadPickle",
        "ChecksumMismatch" => "ChecksumMismatch",
        // Every option misuse; `BadOption` is a `BadOutput`, as convert's misuses were.
        "Misuse" => "BadOption",
        "PushOffline" | "BadHubUrl" | "NotInHubCache" | "HubAuth" | "HubNotFound" | "HubRequest" | "HubCorrupt" => {
            "HubError"
        }
        "DestinationLocked" => "DestinationLocked",
        "DestinationsDiffer" => "DestinationsDiffer",
        _ => match kind {
            K::InvalidData => "InvalidCheckpoint",
            K::NotFound => "NotACheckpoint",
            K::Usage => "BadOutput",
            K::Collective => "ShardedSaveError",
            // An I/O error becomes the matching `OSError` (from its `io_kind`); a kind added
            // later is at least a `CheckpointError`.
            _ => "CheckpointError",
        },
    }
}

/// An option of the library as the Python functions spell it, with the value a message is about.
fn keyword(option: ckpt::Opt, value: Option<&str>) -> String {
    let name = match option {
        ckpt::Opt::To => "to",
        ckpt::Opt::Dtype => "dtype",
        ckpt::Opt::MaxShardSize => "max_shard_size",
        ckpt::Opt::Dedupe => "dedupe",
        ckpt::Opt::WorldSize => "world_size",
        ckpt::Opt::Arch => "arch",
        ckpt::Opt::VocabSize => "vocab_size",
        ckpt::Opt::TensorParallel => "tensor_parallel",
        ckpt::Opt::PipelineParallel => "pipeline_parallel",
        ckpt::Opt::ExpertParallel => "expert_parallel",
        // Not arguments of the Python functions: the library's own spelling.
        other => return other.library_spelling(value),
    };
    match (option, value) {
        (ckpt::Opt::To, Some(v)) => format!("`{name}=\"{v}\"`"),
        (_, Some(v)) => format!("`{name}={v}`"),
        (_, None) => format!("`{name}`"),
    }
}

/// A `dataload` error.
pub(crate) fn dataload(e: dataload::DataloadError) -> PyErr {
    let message = e.to_string();
    dataload_worded(e, message)
}

/// A `dataload` error in the bindings' own words (`message`): one the Python layer found, of a
/// variant of the enum (a record Python's `json` refuses is `NotJson`).
pub(crate) fn dataload_worded(e: dataload::DataloadError, message: String) -> PyErr {
    let variant = e.variant_name().to_owned();
    build("dataload", variant, message, |d| {
        d.set_item("class", dataload_class(&e))?;
        match &e {
            dataload::DataloadError::StateMismatch { field, saved, current } => {
                d.set_item("field", *field)?;
                d.set_item("saved", saved)?;
                d.set_item("current", current)?;
            }
            // Named by the field a loader state holds the order in, its values as JSON.
            dataload::DataloadError::TorchdataMismatch { saved, current } => {
                d.set_item("field", "sampler")?;
                d.set_item("saved", format!("{saved:?}"))?;
                d.set_item("current", format!("{current:?}"))?;
            }
            dataload::DataloadError::Io { path, source } => {
                let (kind, errno) = io_kind(source);
                d.set_item("path", path.display().to_string())?;
                d.set_item("io_kind", kind)?;
                d.set_item("errno", errno)?;
            }
            dataload::DataloadError::NotARegularFile { path, .. } | dataload::DataloadError::FileChanged { path } => {
                d.set_item("path", path.display().to_string())?;
            }
            dataload::DataloadError::NotJson { path, line, .. } => {
                d.set_item("path", path.display().to_string())?;
                d.set_item("line", *line)?;
            }
            _ => {}
        }
        Ok(())
    })
}

/// The `statekit.errors` class of `e`, from its [`dataload::ErrorKind`].
fn dataload_class(e: &dataload::DataloadError) -> &'static str {
    use dataload::ErrorKind as K;
    match e.kind() {
        K::Configuration => "InvalidConfiguration",
        K::State => "MalformedState",
        K::StateMismatch => "StateMismatch",
        K::Collective => "CollectiveError",
        // An I/O error becomes the matching `OSError` (from its `io_kind`).
        K::Data | K::Io => "DataError",
        _ => "DataloadError",
    }
}

/// A usage error found by the bindings themselves (`ValueError` under `StatekitError`).
pub(crate) fn usage(message: impl Into<String>) -> PyErr {
    build("bindings", "Usage".into(), message.into(), |_| Ok(()))
}

/// Runs `f` (a call into the libraries, usually with the GIL released), turning a panic into a
/// `StatekitError` naming `what` (the file or the operation): the last line behind the
/// libraries' own checks, so that no input makes a pyo3 `PanicException` reach Python.
pub(crate) fn unpanicked<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let reason = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(build(
            "dataload",
            "Internal".into(),
            format!("{what}: statekit failed on it ({reason}); this is a bug, please report it with the input"),
            |d| d.set_item("class", "DataError"),
        ))
    })
}
