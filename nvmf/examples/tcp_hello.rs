//! Connects to an NVMe/TCP target's admin queue and prints what the ICReq/ICResp exchange
//! settled, the controller id its Connect returned, and CAP and VS read by Property Get:
//! `cargo run -p nvmf --example tcp_hello -- 127.0.0.1:4420 SUBNQN [hdgst] [ddgst]`.

use std::time::Duration;

use nvme_spec::fabrics::{self, CNTLID_DYNAMIC, ConnectData};
use nvme_spec::tcp::DigestFlags;
use nvmf::tcp::conn::{ConnectOptions, Connection};
use zerocopy::IntoBytes;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().ok_or("give HOST:PORT SUBNQN")?.parse()?;
    let subnqn = args.next().ok_or("give the subsystem's NQN")?;
    let rest: Vec<String> = args.collect();
    let digests = DigestFlags::new()
        .with_hdgst(rest.iter().any(|a| a == "hdgst"))
        .with_ddgst(rest.iter().any(|a| a == "ddgst"));
    let opts = ConnectOptions {
        digests,
        bound: Duration::from_secs(5),
        ..ConnectOptions::default()
    };
    let mut c = Connection::connect(addr, &opts)?;
    println!("{:?}", c.negotiated());
    let host = "nqn.2014-08.org.nvmexpress:uuid:6770756e-766d-6500-0000-000000000001";
    let data = ConnectData::new([0x67; 16], CNTLID_DYNAMIC, &subnqn, host)
        .map_err(|e| format!("NQN of {} bytes", e.len))?;
    // The admin queue: 32 entries, no keep-alive asked (0 ms).
    let done = c.command(fabrics::connect(1, 0, 31, 0, 0), data.as_bytes())?;
    let status = done.status.status();
    if !status.is_success() {
        return Err(format!("Connect failed: {status:?}").into());
    }
    println!("connected: controller id {}", done.dw0 & 0xffff);
    let cap = c.command(fabrics::property_get(2, 0x0, true), &[])?;
    let vs = c.command(fabrics::property_get(3, 0x8, false), &[])?;
    let cap = u64::from(cap.dw0) | (u64::from(cap.dw1) << 32);
    println!(
        "CAP {cap:#018x} (MQES {} entries), VS {}.{}",
        (cap & 0xffff) + 1,
        vs.dw0 >> 16,
        (vs.dw0 >> 8) & 0xff
    );
    Ok(())
}
