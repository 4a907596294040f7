//! Reads or writes namespace 1 of an NVMe/TCP target from or to a file (whole LBAs):
//! `cargo run -p nvmf --example tcp_io -- HOST:PORT SUBNQN write LBA FILE` or
//! `... read LBA BYTES FILE`. Used by `scripts/spdk-test.sh` to check that bytes written
//! over one transport read back over the other.

use nvmf::host::{Controller, HostOptions, Target};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let usage = "HOST:PORT SUBNQN (write LBA FILE | read LBA BYTES FILE)";
    if a.len() < 5 {
        return Err(usage.into());
    }
    let target = Target {
        addr: a[0].parse()?,
        subnqn: a[1].clone(),
    };
    let c = Controller::connect(&target, &HostOptions::default())?;
    let ns = c.namespace(1)?;
    let mut q = c.io_queue(32)?;
    let lba: u64 = a[3].parse()?;
    match (a[2].as_str(), a.len()) {
        ("write", 5) => {
            let data = std::fs::read(&a[4])?;
            q.write(1, lba, &data, ns.lba_size)?;
            println!("wrote {} bytes at LBA {lba}", data.len());
        }
        ("read", 6) => {
            let bytes: usize = a[4].parse()?;
            if bytes == 0 || bytes % ns.lba_size as usize != 0 {
                return Err(format!("{bytes} bytes is not whole {}-byte LBAs", ns.lba_size).into());
            }
            let blocks = u32::try_from(bytes / ns.lba_size as usize)?;
            let data = q.read(1, lba, blocks, ns.lba_size)?;
            std::fs::write(&a[5], &data)?;
            println!("read {} bytes at LBA {lba}", data.len());
        }
        _ => return Err(usage.into()),
    }
    c.shutdown()?;
    Ok(())
}
