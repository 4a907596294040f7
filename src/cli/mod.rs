//! Printing and argument handling of each `gpunvme` command; the work itself lives in the
//! library crates.

pub mod fs;
pub mod identify;
pub mod io;
pub mod perf;
pub mod protocol;
