//! Lists what the discovery controller of an NVMe/TCP target reports, one line per entry
//! (`tcp-subsystem NQN ADDRESS:PORT` for the NVM subsystems reached over TCP, `other ...` for
//! the rest): `cargo run -p nvmf --example tcp_discover -- HOST:PORT`.

use nvmf::discovery;
use nvmf::host::HostOptions;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args().nth(1).ok_or("give HOST:PORT")?.parse()?;
    for e in discovery::discover(addr, &HostOptions::default())? {
        let kind = if e.is_tcp_subsystem() {
            "tcp-subsystem"
        } else {
            "other"
        };
        println!(
            "{kind} {} {}:{} (trtype {}, subtype {}, port {})",
            e.subnqn, e.traddr, e.trsvcid, e.trtype, e.subtype, e.portid
        );
    }
    Ok(())
}
