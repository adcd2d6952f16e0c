//! The unpickler's memory budget: what a pickle may make us hold, charged as it is built.

use std::cell::Cell;
use std::mem::size_of;
use std::rc::Rc;

/// Bounds on what a pickle may make us hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_memo: usize,
    pub max_stack: usize,
    pub max_depth: u32,
    /// Memory budget per byte of pickle (see [`Budget`]).
    pub budget_per_byte: usize,
    /// Memory budget of any pickle, however short.
    pub budget_floor: usize,
    /// Memory budget each pickle adds to a budget shared with others: what running one costs
    /// whatever its length (its first arena, stack and memo slots, its value's walk).
    pub budget_per_pickle: usize,
    /// Memory budget of the longest pickle.
    pub budget_cap: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_memo: 1 << 24,
            max_stack: 1 << 24,
            max_depth: 256,
            // What torch's pickles really hold, counted as the budget counts (arena and stack
            // slots reserved by doubling, the allocator's chunks, hash tables, the values'
            // JSON, each tensor's catalog entry): 36 to 44 bytes per byte for state dicts and
            // optimizers of 60 000 tensors and a config of 400 000 values. The floor covers
            // small files of large values.
            budget_per_byte: 64,
            budget_floor: 16 << 20,
            // A pickle of a few bytes (the `[None]` of an `_extra_state` item, of which a
            // Megatron save of many experts holds one per expert and linear: 30 000 at
            // DeepSeek-V3's size) is charged about 9 KB as read and walked (8.9 KiB: 17.8 MB over 1,960 of them).
            budget_per_pickle: 16 << 10,
            budget_cap: 1 << 30,
        }
    }
}

/// The memory budget of one pickle: `budget_per_byte` × its length + `budget_per_pickle` +
/// `budget_floor`, at most `budget_cap` bytes. The unpickler charges what it builds, and so does every walk over the
/// result ([`super::Pickle::charge`]); charges are never given back, so what the walks build and
/// throw away also counts, which bounds their time as well.
///
/// Pickles whose values are kept together (the shards of one torch checkpoint, the bytes items
/// of one DCP checkpoint, which may all name the same bytes) share one budget ([`Budget::shared`], [`super::Load::budget`]): it grows
/// with each pickle's length and by `budget_per_pickle` with each pickle, and its floor and cap
/// count once.
#[derive(Debug)]
pub(crate) struct Budget {
    limits: Limits,
    /// Bytes of pickle read under this budget.
    pub(super) len: Cell<usize>,
    /// Pickles read under this budget.
    pub(super) pickles: Cell<usize>,
    pub(super) used: Cell<usize>,
}

impl Budget {
    /// A budget for pickles read with `limits`, before any is read.
    pub(crate) fn shared(limits: Limits) -> Rc<Budget> {
        Rc::new(Budget { limits, len: Cell::new(0), pickles: Cell::new(0), used: Cell::new(0) })
    }

    fn limit(&self) -> usize {
        let l = &self.limits;
        let per_pickle = self.pickles.get().saturating_mul(l.budget_per_pickle);
        self.len
            .get()
            .saturating_mul(l.budget_per_byte)
            .saturating_add(per_pickle)
            .saturating_add(l.budget_floor)
            .min(l.budget_cap)
    }

    /// Charges `bytes`; the error is the reason, naming the budget.
    pub(crate) fn charge(&self, bytes: usize) -> std::result::Result<(), String> {
        let used = self.used.get().saturating_add(bytes);
        self.used.set(used);
        if used > self.limit() {
            return Err(format!(
                "memory budget exceeded: the objects and values of {} bytes of pickle need more than {} bytes",
                self.len.get(),
                self.limit()
            ));
        }
        Ok(())
    }

    /// Refuses when `bytes` more would not fit, charging nothing: called before building
    /// something that [`Budget::charge`] is then given once it exists.
    pub(crate) fn afford(&self, bytes: usize) -> std::result::Result<(), String> {
        self.charge(bytes)?;
        self.used.set(self.used.get().saturating_sub(bytes));
        Ok(())
    }

    /// Makes room for `more` elements in `v`, charging what its buffer grows by before it is
    /// allocated (doubling, as `Vec` does; a large buffer is moved by remapping its pages, not
    /// by copying them).
    pub(crate) fn grow<T>(&self, v: &mut Vec<T>, more: usize) -> std::result::Result<(), String> {
        let need = v.len().saturating_add(more);
        if need <= v.capacity() {
            return Ok(());
        }
        let cap = need.max(v.capacity().saturating_mul(2)).max(4);
        self.charge(vec_bytes::<T>(cap) - vec_bytes::<T>(v.capacity()))?;
        v.reserve_exact(cap - v.len());
        Ok(())
    }

    /// Makes room for one more entry in a hash table of `len` entries and room for `cap`,
    /// whose entries are `T`: the capacity to reserve, charged ([`table_bytes`]), or `None`
    /// when it has room.
    pub(crate) fn grow_table<T>(&self, len: usize, cap: usize) -> std::result::Result<Option<usize>, String> {
        if len < cap {
            return Ok(None);
        }
        let cap = cap.saturating_mul(2).max(16);
        self.charge(table_bytes::<T>(cap))?;
        Ok(Some(cap - len))
    }

    /// Bytes charged so far.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.used.get()
    }
}

/// What a heap allocation of `n` bytes takes from the allocator: glibc's chunk of a header word
/// and `n` rounded up to 16 bytes, 32 at least; an empty buffer allocates nothing.
pub(crate) const fn alloc_bytes(n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let chunk = n.saturating_add(8 + 15) & !15;
    if chunk < 32 {
        32
    } else {
        chunk
    }
}

/// The buffer of a vector of `cap` elements of `T`.
pub(crate) const fn vec_bytes<T>(cap: usize) -> usize {
    alloc_bytes(cap.saturating_mul(size_of::<T>()))
}

/// The allocation of a hash table (std's `HashMap`, hashbrown) with room for `cap` entries of
/// `T`: a power of two of buckets at most 7/8 full, each an entry and a control byte.
pub(crate) fn table_bytes<T>(cap: usize) -> usize {
    let buckets = match cap {
        0..4 => 4,
        4..8 => 8,
        _ => (cap.saturating_mul(8) / 7).checked_next_power_of_two().unwrap_or(usize::MAX),
    };
    alloc_bytes(buckets.saturating_mul(size_of::<T>() + 1).saturating_add(16))
}
