//! Strided tensors as runs of contiguous bytes.
//!
//! A torch tensor is a window on a storage: element `(i0, …, ik)` lives at element
//! `offset + Σ i_d · stride_d` of the storage. Reading it row-major is a walk over contiguous
//! runs: dims of size 1 are dropped, neighbouring dims whose strides nest (`stride_d ==
//! size_{d+1} · stride_{d+1}`) merge into one, and the innermost dim is a run when its stride is 1
//! (one element per run otherwise). A contiguous tensor, or a view at an offset, is one run.

/// The row-major walk over a strided tensor, in bytes from the storage start.
#[derive(Clone, Debug)]
pub(crate) struct Runs {
    /// Outer dims (sizes and byte strides) walked with an odometer.
    outer: Vec<(u64, u64)>,
    /// Bytes per run.
    run: u64,
    base: u64,
    idx: Vec<u64>,
    left: u64,
}

/// Elements in a shape, `None` on overflow.
pub(crate) fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
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
        let total = numel(shape).unwrap_or(0);
        let mut dims: Vec<(u64, u64)> =
            shape.iter().zip(strides).filter(|(&n, _)| n != 1).map(|(&n, &s)| (n, s)).collect();
        // Merge nested dims from the inside out.
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(dims.len());
        while let Some((n, s)) = dims.pop() {
            match merged.last_mut() {
                Some((mn, ms)) if s == *mn * *ms => *mn *= n,
                _ => merged.push((n, s)),
            }
        }
        merged.reverse();
        let run_elems = match merged.last() {
            Some(&(n, 1)) => {
                merged.pop();
                n
            }
            Some(_) => 1,
            None => 1,
        };
        let runs = if total == 0 { 0 } else { total / run_elems };
        Runs {
            idx: vec![0; merged.len()],
            outer: merged.into_iter().map(|(n, s)| (n, s * elem)).collect(),
            run: run_elems * elem,
            base: offset * elem,
            left: runs,
        }
    }

    /// How many runs the walk yields.
    pub(crate) fn total(&self) -> u64 {
        self.left
    }
}

impl Iterator for Runs {
    /// `(byte offset from the storage start, byte length)`.
    type Item = (u64, u64);
    fn next(&mut self) -> Option<(u64, u64)> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let at = self.base + self.idx.iter().zip(&self.outer).map(|(&i, &(_, s))| i * s).sum::<u64>();
        for (i, &(n, _)) in self.idx.iter_mut().zip(&self.outer).rev() {
            *i += 1;
            if *i < n {
                break;
            }
            *i = 0;
        }
        Some((at, self.run))
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
        assert_eq!(Runs::new(0, &[0, 5], &[5, 1], 4).total(), 0);
        assert_eq!(Runs::new(7, &[], &[], 8).collect::<Vec<_>>(), vec![(56, 8)]);
        assert_eq!(extent(2, &[4], &[2]), Some(9));
    }
}
