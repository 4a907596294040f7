//! `gpunvme discover nvme-tcp://HOST[:PORT]`: the subsystems an NVMe/TCP target's discovery
//! controller reports (`gpunvme::fabric::discover`), each with the `--device` spec that opens it.

use anyhow::Result;
use gpunvme::fabric::{TcpSpec, discover};

/// Prints the discovery log of `target`.
pub fn run(target: &str, json: bool) -> Result<()> {
    let spec = TcpSpec::parse(target)?;
    let entries = discover(&spec)?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&entries)?);
        return Ok(());
    }
    let mut others = 0;
    for e in &entries {
        match &e.device {
            Some(d) => outln!("{d}"),
            None => others += 1,
        }
    }
    let subsystems = entries.len() - others;
    outln!(
        "{subsystems} NVM subsystem{} over TCP; {others} other entr{} (discovery controllers, \
         other transports: --json lists them)",
        if subsystems == 1 { "" } else { "s" },
        if others == 1 { "y" } else { "ies" }
    );
    Ok(())
}
