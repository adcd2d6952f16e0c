use super::*;

/// The variant's name as `Debug` writes it: what precedes its fields.
fn debug_head(e: &Error) -> String {
    let debug = format!("{e:?}");
    debug.split([' ', '{', '(']).next().unwrap_or_default().to_string()
}

#[test]
fn variant_name_is_the_debug_name() {
    let errors = [
        Error::Io { path: "a.safetensors".into(), source: std::io::Error::other("boom") },
        Error::HeaderTooSmall { path: "a.safetensors".into(), len: 3 },
        Error::NotACheckpoint { path: "nowhere".into() },
        Error::UnknownSafetensorsLayout { path: "dir".into(), count: 2, found: vec!["x.safetensors".into()] },
        Error::BadChecksum {
            path: "model.pt".into(),
            tensor: None,
            rank: None,
            record: "archive/data/0".into(),
            item: None,
            stored: 1,
            actual: 2,
        },
        Error::Misuse { path: "".into(), misuse: crate::Misuse::BadGlobalPattern { pattern: "om*".into() } },
        Error::OutputExists { path: "out".into(), appeared: true },
        Error::OptimizerCollides { path: "out/optimizer.safetensors".into() },
        Error::AlreadyQuantized { dst: "out".into(), weight: "w".into(), scale: "w_scale_inv".into() },
        Error::NotInTorch { dst: "out".into(), tensor: "w".into(), dtype: crate::Dtype::F4 },
        Error::WrongBufferLen { path: "m.safetensors".into(), tensor: "w".into(), expected: 8, found: 4 },
        Error::PushOffline { dst: "hf://o/n".into() },
        Error::NothingToPush { path: "out".into() },
        Error::BadSaveTensor { dst: "out".into(), tensor: "w".into(), problem: SaveTensorProblem::NamedTwice },
        Error::Collective {
            dir: "out".into(),
            source: collective::CollectiveError::NoSuchRoot { op: "broadcast", rank: 0, root: 3, world_size: 2 },
        },
        Error::OtherRank { rank: 1 },
        Error::DestinationLocked { dst: "out".into(), lock: ".out.lock".into(), pid: Some(7) },
        Error::DestinationsDiffer { dst: "out".into(), rank: 1, other: "out1".into() },
        Error::BadMegatron { path: "ckpt".into(), key: Some("k".into()), rank: Some(0), reason: "r".into() },
        Error::MissingMegatronRank { path: "ckpt".into(), rank: 1, tp: 2, pp: 1 },
        Error::NoHfArchitecture { path: "ckpt".into(), arch: Some("llama"), setting: "swiglu", value: "off".into() },
        Error::BadHfConfig {
            path: "config.json".into(),
            key: "hidden_act".into(),
            problem: crate::HfConfigProblem::Activation { found: "gelu".into() },
        },
        Error::BadModelMap {
            path: "ckpt".into(),
            tensor: "w".into(),
            problem: Box::new(MapProblem::Unplaced { view: "one-rank model" }),
        },
        Error::MissingRngFile { path: "random_states_1.pkl".into(), rank: 1, world: 2 },
        Error::ZeroDtype {
            path: "zero_pp_rank_0_mp_rank_00_optim_states.pt".into(),
            rank: 0,
            tensor: "k".into(),
            found: crate::Dtype::F16,
            expected: crate::Dtype::F32,
        },
        Error::RankBeyondLimit { path: "random_states_9999999.pkl".into(), limit: crate::MAX_WORLD_SIZE },
        Error::DcpItemDtype {
            path: "__0_0.distcp".into(),
            tensor: "w".into(),
            rank: Some(0),
            at: 0,
            found: crate::Dtype::F64,
            expected: crate::Dtype::F32,
        },
        Error::BoxDtypeMismatch {
            path: "shard.safetensors".into(),
            tensor: "w".into(),
            rank: None,
            found: crate::Dtype::F64,
            other: crate::Dtype::F32,
        },
        Error::DcpMetadataTooLarge {
            path: ".metadata".into(),
            len: 2,
            cap: 1,
            files: 0,
            data_len: 0,
            items: 0,
            min_item_len: 1,
            per_item: 1,
            min_cap: 1,
        },
        Error::HubAuth { repo: "o/n".into(), file: "f".into(), status: 401, token_source: None, write: false },
        Error::HubNotFound { repo: "o/n".into(), revision: "main".into(), file: None, endpoint: "http://h".into() },
        Error::HubRequest { url: "http://h/o/n".into(), reason: "r".into() },
        Error::HubCorrupt {
            repo: "o/n".into(),
            file: "f".into(),
            problem: HubCorruption::Size { got: 1, announced: 2 },
        },
    ];
    for e in &errors {
        assert_eq!(e.variant_name(), debug_head(e), "{e:?}");
    }
}

/// A refused token is named by where it came from, never by its value, and the advice fits a
/// read or a push.
#[test]
fn hub_auth_messages_name_the_variable_to_set() {
    let read = Error::HubAuth {
        repo: "o/n".into(),
        file: "model.safetensors".into(),
        status: 401,
        token_source: None,
        write: false,
    };
    assert_eq!(
        read.to_string(),
        "`o/n`: the Hub answered 401 for `model.safetensors`; the repository is gated or private: set `HF_TOKEN` \
         (or save a token in `$HF_HOME/token`) to a token that may read it"
    );
    let push = Error::HubAuth {
        repo: "o/n".into(),
        file: "the commit".into(),
        status: 403,
        token_source: Some("`HF_TOKEN`".into()),
        write: true,
    };
    assert_eq!(
        push.to_string(),
        "`o/n`: the Hub answered 403 for `the commit`; the token from `HF_TOKEN` may not write to it (it needs write \
         access to the repository)"
    );
}

/// The typed variants say what the `reason` strings they replace said, word for word.
#[test]
fn typed_variants_keep_their_messages() {
    let cases = [
        (
            Error::DcpItemDtype {
                path: "d/__1_0.distcp".into(),
                tensor: "w".into(),
                rank: Some(1),
                at: 64,
                found: crate::Dtype::F64,
                expected: crate::Dtype::F32,
            },
            "d/__1_0.distcp (rank 1): tensor `w`: the item at byte 64 holds `F64` where the metadata says `F32`",
        ),
        (
            Error::MissingRngFile { path: "s/random_states_1.pkl".into(), rank: 1, world: 3 },
            "s/random_states_1.pkl: rank 1: missing: the folder was saved by 3 ranks and rank 1 left no RNG file",
        ),
        (
            Error::MissingMegatronRank { path: "m/mp_rank_01/model_optim_rng.pt".into(), rank: 1, tp: 2, pp: 1 },
            "m/mp_rank_01/model_optim_rng.pt (rank 1): missing: the save has 2 tensor-parallel × 1 pipeline ranks, \
             but this rank's file is not there",
        ),
        (
            Error::ZeroDtype {
                path: "t/zero_pp_rank_1_mp_rank_00_optim_states.pt".into(),
                rank: 1,
                tensor: "optimizer_state_dict.single_partition_of_fp32_groups.0".into(),
                found: crate::Dtype::F16,
                expected: crate::Dtype::F32,
            },
            "t/zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1, `optimizer_state_dict.single_partition_of_fp32_groups.0`: \
             dtype is `F16`, expected `F32`",
        ),
    ];
    for (e, want) in cases {
        assert_eq!(e.to_string(), want);
    }
}

/// Each option misuse is one variant, worded with the library's own option names; a misuse of an
/// option a source does not take names the source, the others the destination.
#[test]
fn misuses_name_the_option_and_the_file() {
    let not_megatron = crate::Misuse::OptionNotForFormat {
        option: crate::Opt::AsStored,
        source: "m.safetensors".into(),
        format: crate::Format::Safetensors,
    };
    let cases = [
        (
            Error::Misuse { path: "m.safetensors".into(), misuse: not_megatron },
            "`as_stored` applies to Megatron `torch_dist` checkpoints only; m.safetensors is safetensors",
        ),
        (
            Error::Misuse { path: "out".into(), misuse: crate::Misuse::WorldSizeOutOfRange { world: 0 } },
            "cannot convert to out: `world_size` must be from 1 to 1048576, not 0",
        ),
        (
            Error::Misuse { path: "out".into(), misuse: crate::Misuse::ZeroBlock { blocks: crate::Opt::Quantize } },
            "cannot convert to out: the block size of `blocks: Quantize` must be at least 1",
        ),
        (
            Error::Misuse { path: "".into(), misuse: crate::Misuse::BadGlobalPattern { pattern: "om*".into() } },
            "`allow_globals`: `om*` is not a dotted name (`omegaconf.dictconfig.DictConfig`), a prefix ending in \
             `.*` (`omegaconf.*`), or `*`",
        ),
        (
            Error::Misuse { path: "x".into(), misuse: crate::Misuse::RevisionForPath { source: "x".into() } },
            "`revision` applies to `hf://` sources only; x is a path",
        ),
    ];
    for (e, want) in cases {
        assert_eq!(e.kind(), ErrorKind::Usage, "{e:?}");
        assert_eq!(e.to_string(), want);
    }
}

/// What happened, not a sentence: the refusals that were one `BadConvert` each say it in their
/// own variant, with the file they are about.
#[test]
fn refusals_say_what_happened() {
    let cases = [
        (Error::OutputExists { path: "out".into(), appeared: false }, "out: already exists; refusing to write over it"),
        (
            Error::OutputExists { path: "out".into(), appeared: true },
            "out: appeared while the output was written; nothing was committed",
        ),
        (
            Error::OptimizerCollides { path: "o/optimizer.safetensors".into() },
            "cannot convert to o/optimizer.safetensors: the weights and the optimizer states would both be \
             `optimizer.safetensors`",
        ),
        (
            Error::AlreadyQuantized { dst: "q".into(), weight: "w".into(), scale: "w_scale_inv".into() },
            "cannot convert to q: `w_scale_inv` already exists; `w` is not quantized twice",
        ),
        (
            Error::BadSaveTensor {
                dst: "s.safetensors".into(),
                tensor: "w".into(),
                problem: SaveTensorProblem::ByteLen {
                    len: 3,
                    shape: vec![2],
                    dtype: crate::Dtype::F32,
                    holds: Some(8),
                },
            },
            "cannot save s.safetensors: tensor `w` has 3 bytes, but shape [2] of `F32` holds 8",
        ),
        (
            Error::BadSaveTensor {
                dst: "__0_0.distcp".into(),
                tensor: "w".into(),
                problem: SaveTensorProblem::RowsBeyond { at: 2, rows: 3, n0: 4 },
            },
            "cannot save __0_0.distcp: tensor `w` has rows 2..+3, beyond its 4 rows",
        ),
    ];
    for (e, want) in cases {
        assert_eq!(e.kind(), ErrorKind::Usage, "{e:?}");
        assert_eq!(e.to_string(), want);
    }
}

/// Free text is kept only for what this crate does not enumerate (another program's words, the
/// open-ended checks of a format's object graph); every other detail is typed. At most 8
/// variants keep a `reason: String`, each with a comment just above it saying why.
#[test]
fn at_most_eight_variants_keep_free_text() {
    let source = include_str!("../error.rs");
    let lines: Vec<&str> = source.lines().collect();
    let free: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].trim() == "reason: String,").collect();
    assert!(free.len() <= 8, "{} variants keep a `reason: String`; at most 8 may", free.len());
    for i in free {
        let above = lines[i - 1].trim_start();
        assert!(
            above.starts_with("// ") && !above.starts_with("///"),
            "the `reason: String` at line {} of error.rs says why free text is right there",
            i + 1
        );
    }
}
