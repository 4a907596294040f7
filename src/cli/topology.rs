//! `gpunvme topology`: where the machine's NVIDIA GPUs and NVMe controllers sit on PCIe, read
//! from sysfs (`gpu_queues::transport::topology`), as the matrix of path classes `nvidia-smi
//! topo -m` prints. No device is opened.

use std::path::Path;

use anyhow::Result;
use gpu_queues::transport::topology::{DeviceKind, Matrix, find};
use serde_json::json;

/// Prints the matrix of every GPU against every NVMe controller under `sys_root`.
pub fn run(sys_root: &Path, json: bool) -> Result<()> {
    let gpus = find(sys_root, DeviceKind::NvidiaGpu)?;
    let nvmes = find(sys_root, DeviceKind::Nvme)?;
    let m = Matrix::of(sys_root, &gpus, &nvmes)?;
    if json {
        let place = |p: &gpu_queues::transport::topology::Place| json!({ "address": p.address, "host_bridge": p.host_bridge, "numa_node": p.numa_node });
        let classes: Vec<Vec<&str>> = m
            .classes
            .iter()
            .map(|row| row.iter().map(|c| c.name()).collect())
            .collect();
        let v = json!({
            "gpus": m.gpus.iter().map(place).collect::<Vec<_>>(),
            "controllers": m.controllers.iter().map(place).collect::<Vec<_>>(),
            "classes": classes,
            "nearest": m.nearest(),
        });
        outln!("{v}");
    } else {
        outln!("{m}");
    }
    Ok(())
}
