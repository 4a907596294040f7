//! The same transfer shapes and wrap-around on SPDK's NVMe-oF target over the vfio-user
//! transport: a controller gpunvme did not write. `scripts/spdk-gpu-test.sh` starts the target
//! and runs these with `GPUNVME_TEST_SPDK_DIR` set to its state directory (sockets
//! `DIR/NAME/cntrl`); `scripts/gpu-test.sh` leaves them to it.

use super::*;

/// GPU queues over vfio-user on the target's controller `name` (malloc512, malloc4096).
fn spdk_rig(name: &str, queues: u16, depth: u32) -> Rig {
    let dir = std::env::var_os("GPUNVME_TEST_SPDK_DIR").expect(
        "GPUNVME_TEST_SPDK_DIR names a running spdk-target.sh state directory \
         (scripts/spdk-gpu-test.sh sets it)",
    );
    let socket = std::path::Path::new(&dir).join(name).join("cntrl");
    let dev = vfio::VfioUserNvme::open(&socket, &vfio::VfioUserOptions::default())
        .expect("connecting to SPDK's target");
    let ctrl = Controller::new(dev.clone(), ControllerOptions::default()).expect("bring-up");
    let opts = GpuQueueOptions {
        queues: Some(queues),
        depth: Some(depth),
        ..Default::default()
    };
    let (gpu, _) = gpu_queues::transport::open_vfio_user(&cuda(), &ctrl, dev, &opts)
        .expect("GPU queues over vfio-user");
    let lba = ctrl.namespace(1).expect("namespace 1").lba_size;
    Rig {
        gpu,
        model: None,
        ctrl,
        emu: None,
        lba,
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/spdk-gpu-test.sh runs it on the GPU machine)"]
fn every_transfer_shape_on_spdk() {
    for (name, lba) in [("malloc512", 512), ("malloc4096", 4096)] {
        let r = spdk_rig(name, 2, 64);
        assert_eq!(r.lba, lba, "{name}'s block size");
        transfer_shapes(&r);
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/spdk-gpu-test.sh runs it on the GPU machine)"]
fn wrap_around_many_queues_on_spdk() {
    for (warp, depth) in [(false, 16u32), (true, 32)] {
        wrap_around(&spdk_rig("malloc512", 8, depth), warp, depth);
    }
}
