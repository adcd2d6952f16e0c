//! The data sources and the prefetching loader (the `sources` feature): each fixture format
//! read as numpy, pyarrow and json read it (`formats`), hostile files (`hostile`,
//! `hostile_files`), the loader with any number of workers (`prefetch_loader`) and mixtures of
//! sources resumed on any number of ranks (`mixture`).

mod formats;
mod hostile;
mod hostile_files;
mod mixture;
mod prefetch_loader;
