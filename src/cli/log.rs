//! `gpunvme log`: the error log or SMART / Health Information.

use anyhow::Result;
use nvme::Controller;

/// Prints the Error Information log, or SMART / Health Information with `smart`.
pub fn run(ctrl: &Controller, smart: bool, as_json: bool) -> Result<()> {
    if smart {
        let r = gpunvme::logs::smart(ctrl)?;
        if as_json {
            outln!("{}", serde_json::to_string_pretty(&r)?);
        } else {
            outln!("{r}");
        }
    } else {
        let r = gpunvme::logs::error_log(ctrl)?;
        if as_json {
            outln!("{}", serde_json::to_string_pretty(&r)?);
        } else {
            outln!("{r}");
        }
    }
    Ok(())
}
