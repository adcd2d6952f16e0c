//! The machine's limits and refusals, one behaviour per test.
#![allow(clippy::unwrap_used)]
use super::*;

fn bad(data: &[u8], limits: Limits) -> String {
    match load(data, Load { limits, ..Load::default() }) {
        Err(Refusal::Bad { reason, .. }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn one_memory_budget_scaled_to_the_pickle() {
    let tiny = Limits {
        budget_per_byte: 2,
        budget_floor: 10_000,
        budget_per_pickle: 0,
        budget_cap: 1 << 20,
        ..Limits::default()
    };
    // 64 arena slots fit in 10 000 bytes, 128 do not: the arena is charged as it grows.
    let lists = |n: usize| [&b"\x80\x02"[..], &vec![b']'; n], b"."].concat();
    assert!(load(&lists(64), Load { limits: tiny, ..Load::default() }).is_ok());
    assert_eq!(
        bad(&lists(65), tiny),
        "memory budget exceeded: the objects and values of 68 bytes of pickle need more than 10136 bytes"
    );
    // A memo fetch shares the object: a 4 KiB string fetched 3 000 times costs its index.
    let s = [&b"\x80\x02]X\x00\x10\x00\x00"[..], &[b'a'; 4096], b"q\x00a(", &b"h\x00".repeat(3000), b"e."].concat();
    let p = load(&s, Load::default()).unwrap_or_else(|e| panic!("{e:?}"));
    // Its index in the list and on the stack, and slots: not 3 000 copies (12 MB).
    assert!(p.budget.used() < 4096 + 3000 * 48 + 64 * 108, "{}", p.budget.used());
    // The cap holds whatever the length.
    let capped = Limits { budget_cap: 5_000, ..tiny };
    assert!(bad(&lists(64), capped).ends_with("need more than 5000 bytes"));
}

/// Many short pickles sharing one budget (a Megatron save's `_extra_state` items, one per
/// expert and linear) each bring what running one costs: 40 000 `[None]`s are read, where
/// their bytes alone would have run out of budget after about 2 000.
#[test]
fn each_pickle_of_a_shared_budget_brings_its_own_allowance() {
    let budget = Budget::shared(Limits::default());
    let none = b"\x80\x02]q\x00Na.";
    for i in 0..40_000 {
        let p = load(none, Load::default().charging(&budget)).unwrap_or_else(|e| panic!("pickle {i}: {e:?}"));
        // The walk a DCP bytes item gets, charged to the same budget.
        crate::formats::torch::flatten::leaf_of_describing_tensors(&p).unwrap_or_else(|e| panic!("pickle {i}: {e}"));
    }
    // Each still pays its way: with almost no allowance, the same pickles soon run out.
    let tight = Budget::shared(Limits { budget_floor: 0, budget_per_pickle: 64, ..Limits::default() });
    let refused = (0..100).any(|_| load(none, Load::default().charging(&tight)).is_err());
    assert!(refused);
}

#[test]
fn memo_is_bounded() {
    let small = Limits { max_memo: 2, ..Limits::default() };
    assert_eq!(bad(b"\x80\x02Nq\x00q\x01q\x02.", small), "memo grows past 2 entries");
    // Overwriting a slot does not grow the memo.
    assert!(load(b"\x80\x02Nq\x00q\x00q\x00.", Load { limits: small, ..Load::default() }).is_ok());
    assert_eq!(bad(b"\x80\x02h\x05.", Limits::default()), "memo slot 5 is read before it is written");
}

#[test]
fn declared_lengths_are_checked_before_allocating() {
    assert_eq!(
        bad(b"\x80\x02X\xff\xff\xff\x7fabc", Limits::default()),
        "declared length 2147483647 runs past the end of the pickle"
    );
    assert_eq!(
        bad(b"\x80\x02\x8e\xff\xff\xff\xff\xff\xff\xff\x7f", Limits::default()),
        "declared length 9223372036854775807 runs past the end of the pickle"
    );
}

#[test]
fn stack_and_marks_are_bounded() {
    let small = Limits { max_stack: 3, max_depth: 2, ..Limits::default() };
    assert_eq!(bad(b"\x80\x02NNNN.", small), "stack grows past 3 values");
    assert_eq!(bad(b"\x80\x02(((", small), "nesting deeper than 2 levels");
    assert_eq!(bad(b"\x80\x02]]]]aaa.", Limits { max_depth: 2, ..Limits::default() }), "nesting deeper than 2 levels");
}

#[test]
fn unknown_opcodes_and_calls_are_refused() {
    assert_eq!(bad(b"\x80\x02I1\n.", Limits::default()), "unsupported opcode 0x49");
    assert_eq!(bad(b"\x80\x02.", Limits::default()), "stack underflow");
    assert_eq!(bad(b"\x80\x02N)R.", Limits::default()), "REDUCE calls None, not an allowed global");
    let g = load(b"\x80\x02\x8c\x05torch\x8c\x0cFloatStorage\x93.", Load::default());
    assert!(
        matches!(g, Ok(p) if matches!(p.obj(p.root), Some(Obj::Global(Global::Storage(StorageKind::Typed(Dtype::F32))))))
    );
    assert_eq!(
        load(b"\x80\x04\x8c\x02os\x8c\x06system\x93.", Load::default()).err(),
        Some(Refusal::Global("os.system".into()))
    );
}

#[test]
fn storage_views_stay_inside_their_storage() {
    let pid = |view: &[u8]| {
        [&b"\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x06\x00\x00\x00cuda:0K\x04"[..], view, b"tQ"].concat()
    };
    let past = [pid(b"X\x01\x00\x00\x001K\x02K\x03\x87"), b".".to_vec()].concat();
    assert_eq!(bad(&past, Limits::default()), "storage view of 3 elements at 2 runs past its 4-element storage");
    // `_rebuild_tensor(view, 1, (2,), (1,))` on a 2-element view: one element too far.
    let t = [
        &b"\x80\x02ctorch._utils\n_rebuild_tensor\n("[..],
        &pid(b"X\x01\x00\x00\x001K\x01K\x02\x87"),
        b"K\x01K\x02\x85K\x01\x85tR.",
    ]
    .concat();
    assert_eq!(bad(&t, Limits::default()), "tensor reaches past its 2-element storage view");
    let ok = [&t[..t.len() - 11], b"K\x00K\x02\x85K\x01\x85tR."].concat();
    let p = load(&ok, Load::default()).unwrap_or_else(|e| panic!("{e:?}"));
    let Some(Obj::Tensor(t)) = p.obj(p.root) else { panic!("not a tensor") };
    assert_eq!((t.offset, t.storage.numel), (1, 4), "offset into the whole storage");
}

#[test]
fn format_classes_become_inert_instances_only_where_allowed() {
    // `pkg.Thing()` via NEWOBJ, then BUILD with `{"a": 5}`: how dataclasses are pickled.
    let data = b"\x80\x02cpkg\nThing\n)\x81}X\x01\x00\x00\x00aK\x05sb.";
    assert_eq!(load(data, Load::default()).err(), Some(Refusal::Global("pkg.Thing".into())));
    let p = load(data, Load::default().classes(&["pkg.Thing"])).unwrap_or_else(|e| panic!("{e:?}"));
    let Some(Obj::Instance { class, args, state: Some(state), .. }) = p.obj(p.root) else { panic!("not an instance") };
    assert_eq!((&**class, args.len()), ("pkg.Thing", 0));
    let Some(Obj::Dict(fields)) = p.obj(*state) else { panic!("state is not a dict") };
    assert_eq!(fields.len(), 1);
    assert_eq!(fields[0].1, V::Int(5));
    // A second BUILD on the same instance is refused: state is set once.
    let twice = b"\x80\x02cpkg\nThing\n)\x81}b}b.";
    assert!(load(twice, Load::default().classes(&["pkg.Thing"])).is_err());
}
