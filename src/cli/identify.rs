//! `gpunvme identify`: the controller and its namespaces.

use anyhow::Result;
use gpunvme_cli::report::{IdentifyAllReport, IdentifyReport};
use nvme::Controller;

/// Prints the controller's identity and namespaces.
pub fn run(ctrl: &Controller, as_json: bool) -> Result<()> {
    let report = IdentifyReport::of(ctrl);
    if as_json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!("{report}");
    }
    Ok(())
}

/// Prints each controller's identity and namespaces, then the totals (several --device).
pub fn run_all(ctrls: &[Controller], as_json: bool) -> Result<()> {
    let report = IdentifyAllReport::of(ctrls);
    if as_json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!("{report}");
    }
    Ok(())
}
