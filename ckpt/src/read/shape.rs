//! Strided tensors as runs of contiguous bytes.
//!
//! A torch tensor is a window on a storage: element `(i0, …, ik)` lives at element
//! `offset + Σ i_d · stride_d` of the storage. Reading it row-major is a walk over contiguous
//! runs: dims of size 1 are dropped, neighbouring dims whose strides nest (`stride_d ==
//! size_{d+1} · stride_{d+1}`) merge into one, and the innermost dim is a run when its stride is 1
//! (one element per run otherwise). A contiguous tensor, or a view at an offset, is one run.

/// The row-major walk over a strided tensor, in bytes from the storage start.
#[derive(Clone, Debug)]
pub(crate) struct Runs(Walk);

/// The row-major walk over a box of a larger tensor whose elements are a strided view on a
/// storage: each step is a run of elements contiguous both in the storage and in the larger
/// tensor's row-major order. For a box that is the whole tensor this is [`Runs`].
#[derive(Clone, Debug)]
pub(crate) struct Walk {
    /// Outer dims (size, storage byte stride, target byte stride) walked with an odometer.
    outer: Vec<(u64, u64, u64)>,
    /// Bytes per run.
    run: u64,
    src_base: u64,
    dst_base: u64,
    idx: Vec<u64>,
    left: u64,
}

/// Elements in a shape, `None` on overflow.
pub(crate) fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

/// Row-major (contiguous) strides of a shape, in elements; `None` on overflow.
pub(crate) fn contiguous_strides(shape: &[u64]) -> Option<Vec<u64>> {
    let mut out = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for (o, &n) in out.iter_mut().zip(shape).rev() {
        *o = acc;
        acc = acc.checked_mul(n)?;
    }
    Some(out)
}

/// The highest element index a tensor touches plus one (0 for an empty tensor), `None` on
/// overflow.
pub(crate) fn extent(offset: u64, shape: &[u64], strides: &[u64]) -> Option<u64> {
    if shape.contains(&0) {
        return Some(0);
    }
    let mut last = offset;
    for (&n, &s) in shape.iter().zip(strides) {
        last = last.checked_add((n - 1).checked_mul(s)?)?;
    }
    last.checked_add(1)
}

impl Runs {
    /// The runs of a tensor; the caller has checked that [`extent`] fits the storage, so no
    /// arithmetic here overflows.
    pub(crate) fn new(offset: u64, shape: &[u64], strides: &[u64], elem: u64) -> Runs {
        let dst = contiguous_strides(shape).unwrap_or_else(|| vec![0; shape.len()]);
        Runs(Walk::new(offset, shape, strides, 0, &dst, elem))
    }
}

impl Iterator for Runs {
    /// `(byte offset from the storage start, byte length)`.
    type Item = (u64, u64);
    fn next(&mut self) -> Option<(u64, u64)> {
        self.0.next().map(|(_, src, len)| (src, len))
    }
}

impl Walk {
    /// The walk over `sizes` elements read at `src_offset + Σ i·src_strides` of the storage and
    /// placed at `dst_offset + Σ i·dst_strides` of the target (all in elements). The caller has
    /// checked that both extents fit, so no arithmetic here overflows.
    pub(crate) fn new(
        src_offset: u64,
        sizes: &[u64],
        src_strides: &[u64],
        dst_offset: u64,
        dst_strides: &[u64],
        elem: u64,
    ) -> Walk {
        let total = numel(sizes).unwrap_or(0);
        let mut dims: Vec<(u64, u64, u64)> = sizes
            .iter()
            .zip(src_strides.iter().zip(dst_strides))
            .filter(|(&n, _)| n != 1)
            .map(|(&n, (&s, &d))| (n, s, d))
            .collect();
        // Merge dims from the inside out where both sides nest.
        let mut merged: Vec<(u64, u64, u64)> = Vec::with_capacity(dims.len());
        while let Some((n, s, d)) = dims.pop() {
            match merged.last_mut() {
                Some((mn, ms, md)) if s == *mn * *ms && d == *mn * *md => *mn *= n,
                _ => merged.push((n, s, d)),
            }
        }
        merged.reverse();
        let run_elems = match merged.last() {
            Some(&(n, 1, 1)) => {
                merged.pop();
                n
            }
            _ => 1,
        };
        let runs = if total == 0 { 0 } else { total / run_elems };
        Walk {
            idx: vec![0; merged.len()],
            outer: merged.into_iter().map(|(n, s, d)| (n, s * elem, d * elem)).collect(),
            run: run_elems * elem,
            src_base: src_offset * elem,
            dst_base: dst_offset * elem,
            left: runs,
        }
    }

    /// How many runs the walk yields from here.
    pub(crate) fn total(&self) -> u64 {
        self.left
    }
}

impl Iterator for Walk {
    /// `(target byte offset, storage byte offset, byte length)`.
    type Item = (u64, u64, u64);
    fn next(&mut self) -> Option<(u64, u64, u64)> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let (mut src, mut dst) = (self.src_base, self.dst_base);
        for (&i, &(_, s, d)) in self.idx.iter().zip(&self.outer) {
            src += i * s;
            dst += i * d;
        }
        for (i, &(n, _, _)) in self.idx.iter_mut().zip(&self.outer).rev() {
            *i += 1;
            if *i < n {
                break;
            }
            *i = 0;
        }
        Some((dst, src, self.run))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_view_is_one_run() {
        let r: Vec<_> = Runs::new(2, &[3, 4], &[4, 1], 4).collect();
        assert_eq!(r, vec![(8, 48)]);
    }

    #[test]
    fn transpose_is_one_element_per_run() {
        // (3,2) view with strides (1,3) of a (2,3) storage.
        let r: Vec<_> = Runs::new(0, &[3, 2], &[1, 3], 4).map(|(o, _)| o / 4).collect();
        assert_eq!(r, vec![0, 3, 1, 4, 2, 5]);
    }

    #[test]
    fn slices_and_broadcasts() {
        let r: Vec<_> = Runs::new(1, &[2, 2], &[4, 1], 1).collect();
        assert_eq!(r, vec![(1, 2), (5, 2)]);
        let r: Vec<_> = Runs::new(0, &[3], &[0], 2).collect();
        assert_eq!(r, vec![(0, 2), (0, 2), (0, 2)]);
        assert_eq!(Runs::new(0, &[0, 5], &[5, 1], 4).count(), 0);
        assert_eq!(Runs::new(7, &[], &[], 8).collect::<Vec<_>>(), vec![(56, 8)]);
        assert_eq!(extent(2, &[4], &[2]), Some(9));
    }

    #[test]
    fn a_box_of_a_larger_tensor_runs_row_by_row() {
        // Columns 2..4 of a (3, 6) tensor, stored compact as (3, 2): one run per row.
        let r: Vec<_> = Walk::new(0, &[3, 2], &[2, 1], 2, &[6, 1], 4).collect();
        assert_eq!(r, vec![(8, 0, 8), (32, 8, 8), (56, 16, 8)]);
        // Rows 1..3 of the same tensor: one run.
        let r: Vec<_> = Walk::new(0, &[2, 6], &[6, 1], 6, &[6, 1], 1).collect();
        assert_eq!(r, vec![(6, 0, 12)]);
        // A channels_last (1, 3, 2, 2) box stored with strides (12, 1, 6, 3): one element a run.
        let w = Walk::new(0, &[1, 3, 2, 2], &[12, 1, 6, 3], 0, &[12, 4, 2, 1], 1);
        assert_eq!(w.total(), 12);
        let src: Vec<u64> = w.map(|(_, s, _)| s).collect();
        assert_eq!(src, vec![0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]);
        assert_eq!(contiguous_strides(&[2, 3, 4]), Some(vec![12, 4, 1]));
    }
}
