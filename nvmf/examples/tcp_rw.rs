//! Brings up an NVMe/TCP target's controller (Connect, CC.EN, Identify, Number of Queues,
//! Keep Alive), writes patterns to namespace 1 over an I/O queue, reads them back and compares,
//! then shuts the controller down:
//! `cargo run -p nvmf --example tcp_rw -- 127.0.0.1:4420 SUBNQN [hdgst] [ddgst]`.

use std::time::Duration;

use nvme_spec::tcp::DigestFlags;
use nvmf::host::{Controller, HostOptions, Target};
use nvmf::tcp::conn::ConnectOptions;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().ok_or("give HOST:PORT SUBNQN")?.parse()?;
    let subnqn = args.next().ok_or("give the subsystem's NQN")?;
    let rest: Vec<String> = args.collect();
    let digests = DigestFlags::new()
        .with_hdgst(rest.iter().any(|a| a == "hdgst"))
        .with_ddgst(rest.iter().any(|a| a == "ddgst"));
    let opts = HostOptions {
        connect: ConnectOptions {
            digests,
            bound: Duration::from_secs(5),
            ..ConnectOptions::default()
        },
        ..HostOptions::default()
    };
    let c = Controller::connect(&Target { addr, subnqn }, &opts)?;
    let id = c.identify();
    println!(
        "controller {}: {} {} (VS {:#x}, MQES {}, {} I/O queues, {} bytes in-capsule, {} per command)",
        c.cntlid(),
        String::from_utf8_lossy(&id.mn).trim(),
        String::from_utf8_lossy(&id.sn).trim(),
        c.version(),
        c.cap().max_queue_entries(),
        c.io_queues(),
        c.io_in_capsule(),
        c.max_transfer()
    );
    let ns = c.namespace(1)?;
    println!("namespace 1: {} blocks of {} bytes", ns.blocks, ns.lba_size);
    let mut q = c.io_queue(32)?;
    for (i, bytes) in [512usize, 4096, 8192, 65536, 1 << 20, 3 << 20]
        .into_iter()
        .enumerate()
    {
        let bytes = bytes.max(ns.lba_size as usize);
        let blocks = (bytes / ns.lba_size as usize) as u32;
        let lba = (i as u64) * (8 << 20) / u64::from(ns.lba_size);
        let data: Vec<u8> = (0..bytes).map(|b| (b * 7 + i * 13) as u8).collect();
        q.write(1, lba, &data, ns.lba_size)?;
        let back = q.read(1, lba, blocks, ns.lba_size)?;
        assert!(back == data, "{bytes} bytes at LBA {lba} read back differ");
        println!("{bytes} bytes at LBA {lba}: written and read back equal");
    }
    c.shutdown()?;
    println!("shut down");
    Ok(())
}
