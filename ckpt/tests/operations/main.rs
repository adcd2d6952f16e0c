//! The operations themselves, whatever the format: split then merge is the identity (property
//! tests), one operation over the ranks of a job writes what one process writes, and a
//! checkpoint written over another stays whole until the new index replaces the old.

mod properties;
mod ranks;
mod replace_in_place;
