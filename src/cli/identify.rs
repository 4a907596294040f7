//! `gpunvme identify`: the controller and its namespaces.

use anyhow::Result;
use nvme::Controller;
use serde_json::json;

/// Prints the controller's identity and namespaces.
pub fn run(ctrl: &Controller, as_json: bool) -> Result<()> {
    let info = ctrl.info();
    let namespaces: Vec<_> = ctrl
        .namespaces()
        .iter()
        .map(|ns| json!({ "nsid": ns.nsid, "lba_size": ns.lba_size, "blocks": ns.blocks }))
        .collect();
    if as_json {
        let v = json!({
            "vid": info.vid,
            "ssvid": info.ssvid,
            "sn": info.sn,
            "mn": info.mn,
            "fr": info.fr,
            "mdts_bytes": info.mdts_bytes,
            "max_io_queue_pairs": info.max_io_queue_pairs,
            "namespaces": namespaces,
            "device": ctrl.device().describe(),
        });
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    outln!("device:             {}", ctrl.device().describe());
    outln!(
        "vendor id:          {:#06x} (subsystem {:#06x})",
        info.vid,
        info.ssvid
    );
    outln!("serial number:      {}", info.sn);
    outln!("model:              {}", info.mn);
    outln!("firmware:           {}", info.fr);
    match info.mdts_bytes {
        Some(b) => outln!("max transfer:       {b} bytes"),
        None => outln!("max transfer:       unlimited"),
    }
    outln!("I/O queue pairs:    {}", info.max_io_queue_pairs);
    for ns in ctrl.namespaces() {
        outln!(
            "namespace {}:        {} blocks of {} bytes ({})",
            ns.nsid,
            ns.blocks,
            ns.lba_size,
            gpunvme::units::format_bytes((ns.blocks * ns.lba_size as u64) as f64)
        );
    }
    Ok(())
}
