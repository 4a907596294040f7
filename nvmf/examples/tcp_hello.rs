//! Connects to an NVMe/TCP target and prints what the ICReq/ICResp exchange settled:
//! `cargo run -p nvmf --example tcp_hello -- 127.0.0.1:4420 [hdgst] [ddgst]`.

use std::time::Duration;

use nvme_spec::tcp::DigestFlags;
use nvmf::tcp::conn::{ConnectOptions, Connection};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().ok_or("give HOST:PORT")?.parse()?;
    let rest: Vec<String> = args.collect();
    let digests = DigestFlags::new()
        .with_hdgst(rest.iter().any(|a| a == "hdgst"))
        .with_ddgst(rest.iter().any(|a| a == "ddgst"));
    let opts = ConnectOptions {
        digests,
        bound: Duration::from_secs(5),
        ..ConnectOptions::default()
    };
    let c = Connection::connect(addr, &opts)?;
    println!("{:?}", c.negotiated());
    Ok(())
}
