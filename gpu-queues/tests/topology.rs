//! The GPU–controller topology classifier on fake sysfs trees: a DGX-like machine (two sockets,
//! four PCIe switches each holding two GPUs and two NVMe controllers), a flat VM, pairs across
//! host bridges of one NUMA node and across sockets.

use std::os::unix::fs::symlink;
use std::path::Path;

use gpu_queues::transport::topology::{
    DeviceKind, Matrix, PathClass, classify, find, p2p_verdict, pair_class, place,
};

/// Adds device `addr` at `devices/<path>/<addr>` with its class, vendor and NUMA node, and its
/// `bus/pci/devices` link.
fn device(root: &Path, path: &str, addr: &str, class: &str, vendor: &str, numa: i32) {
    let dir = root.join("devices").join(path).join(addr);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("class"), format!("{class}\n")).unwrap();
    std::fs::write(dir.join("vendor"), format!("{vendor}\n")).unwrap();
    std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
    let bus = root.join("bus/pci/devices");
    std::fs::create_dir_all(&bus).unwrap();
    symlink(&dir, bus.join(addr)).unwrap();
}

const GPU: (&str, &str) = ("0x030200", "0x10de");
const NVME: (&str, &str) = ("0x010802", "0x144d");

/// Two sockets, two host bridges each; under each host bridge a root port and a two-level
/// switch (a top switch, and a leaf switch per pair of GPUs and pair of NVMe controllers).
fn dgx(root: &Path) -> (Vec<String>, Vec<String>) {
    let (mut gpus, mut nvmes) = (Vec::new(), Vec::new());
    for hb in 0..4u32 {
        let numa = (hb / 2) as i32;
        let bus = 0x10 * (hb + 1);
        let host = format!("pci0000:{bus:02x}");
        let rp = format!("0000:{bus:02x}:01.0");
        let top = format!("0000:{:02x}:00.0", bus + 1);
        let leaf_port = format!("0000:{:02x}:00.0", bus + 2);
        let leaf = format!("0000:{:02x}:00.0", bus + 3);
        let base = format!("{host}/{rp}/{top}/{leaf_port}/{leaf}");
        for i in 0..2u32 {
            let dsp = format!("0000:{:02x}:{:02x}.0", bus + 4, i);
            let g = format!("0000:{:02x}:00.0", bus + 5 + i);
            device(root, &format!("{base}/{dsp}"), &g, GPU.0, GPU.1, numa);
            gpus.push(g);
            let dsp = format!("0000:{:02x}:{:02x}.0", bus + 4, i + 2);
            let n = format!("0000:{:02x}:00.0", bus + 7 + i);
            device(root, &format!("{base}/{dsp}"), &n, NVME.0, NVME.1, numa);
            nvmes.push(n);
        }
    }
    (gpus, nvmes)
}

#[test]
fn a_dgx_like_tree_pairs_each_gpu_with_the_nvme_behind_its_switch() {
    let root = tempfile::tempdir().unwrap();
    let (gpus, nvmes) = dgx(root.path());
    assert_eq!(find(root.path(), DeviceKind::NvidiaGpu).unwrap(), {
        let mut g = gpus.clone();
        g.sort();
        g
    });
    assert_eq!(find(root.path(), DeviceKind::Nvme).unwrap().len(), 8);
    let m = Matrix::of(root.path(), &gpus, &nvmes).unwrap();
    for (g, row) in m.classes.iter().enumerate() {
        for (c, class) in row.iter().enumerate() {
            let want = if g / 2 == c / 2 {
                PathClass::Pix // behind the same leaf switch
            } else if g / 4 == c / 4 {
                PathClass::Node // another host bridge of the same socket
            } else {
                PathClass::Sys
            };
            assert_eq!(*class, want, "GPU {} to NVMe {}", gpus[g], nvmes[c]);
        }
    }
    // Each GPU's nearest controllers are the two behind its own leaf switch, and with every
    // GPU at work on every controller, those are the pairs: each drive driven by its two GPUs.
    for (g, near) in m.nearest().iter().enumerate() {
        assert_eq!(near, &vec![g / 2 * 2, g / 2 * 2 + 1]);
    }
    let want: Vec<(usize, usize)> = (0..8)
        .flat_map(|g| [(g, g / 2 * 2), (g, g / 2 * 2 + 1)])
        .collect();
    assert_eq!(m.pairs(), want);
    // Half the drives gone (one per switch): each GPU still gets the one behind its switch.
    let half: Vec<String> = nvmes.iter().step_by(2).cloned().collect();
    let m2 = Matrix::of(root.path(), &gpus, &half).unwrap();
    assert_eq!(m2.pairs(), (0..8).map(|g| (g, g / 2)).collect::<Vec<_>>());
    // Two GPUs of one socket against drives of the other: all alike (SYS), every pair.
    let m3 = Matrix::of(root.path(), &gpus[..2], &nvmes[4..6]).unwrap();
    assert_eq!(m3.pairs(), vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
    // One GPU and one drive near it, one far from every GPU: the far drive is the nearest GPU's.
    let m4 = Matrix::of(
        root.path(),
        &gpus[..1],
        &[nvmes[0].clone(), nvmes[7].clone()],
    )
    .unwrap();
    assert_eq!(m4.pairs(), vec![(0, 0), (0, 1)]);
    let shown = m.to_string();
    assert!(
        shown.contains("PIX") && shown.contains("SYS") && shown.contains("NODE"),
        "{shown}"
    );
    assert_eq!(shown.lines().count(), 1 + 8 + 1, "{shown}");
}

#[test]
fn nested_switches_and_root_ports() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    // Under one root port: a switch; the GPU one switch below it, one NVMe beside, one NVMe
    // behind a second switch; another NVMe on a root port of its own.
    let sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
    device(
        r,
        &format!("{sw}/0000:02:00.0"),
        "0000:03:00.0",
        GPU.0,
        GPU.1,
        0,
    );
    device(
        r,
        &format!("{sw}/0000:02:01.0"),
        "0000:04:00.0",
        NVME.0,
        NVME.1,
        0,
    );
    let deeper = format!("{sw}/0000:02:02.0/0000:05:00.0/0000:06:00.0");
    device(r, &deeper, "0000:07:00.0", NVME.0, NVME.1, 0);
    device(
        r,
        "pci0000:00/0000:00:02.0",
        "0000:08:00.0",
        NVME.0,
        NVME.1,
        0,
    );
    let p = |a: &str| place(r, a).unwrap();
    let gpu = p("0000:03:00.0");
    assert_eq!(gpu.host_bridge, "pci0000:00");
    assert_eq!(gpu.numa_node, Some(0));
    assert_eq!(classify(&gpu, &p("0000:04:00.0")), PathClass::Pix);
    assert_eq!(classify(&gpu, &p("0000:07:00.0")), PathClass::Pxb);
    assert_eq!(classify(&gpu, &p("0000:08:00.0")), PathClass::Phb);
}

#[test]
fn a_flat_vm_tree_is_through_the_host_bridge_and_unknown_numa_is_one_node() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    device(r, "pci0000:00", "0000:00:04.0", GPU.0, GPU.1, -1);
    device(r, "pci0000:00", "0000:00:05.0", NVME.0, NVME.1, -1);
    device(r, "pci0000:01", "0000:01:00.0", NVME.0, NVME.1, -1);
    let m = Matrix::of(
        r,
        &["0000:00:04.0".into()],
        &["0000:00:05.0".into(), "0000:01:00.0".into()],
    )
    .unwrap();
    assert_eq!(m.classes, vec![vec![PathClass::Phb, PathClass::Node]]);
    // One GPU: it drives both controllers, the far one too (no other GPU is nearer).
    assert_eq!(m.pairs(), vec![(0, 0), (0, 1)]);
    assert_eq!(m.gpus[0].numa_node, None);
    // A QEMU virtio GPU is not an NVIDIA one; nothing else is found as NVMe.
    device(r, "pci0000:00", "0000:00:06.0", "0x030000", "0x1af4", -1);
    assert_eq!(
        find(r, DeviceKind::NvidiaGpu).unwrap(),
        vec!["0000:00:04.0"]
    );
}

#[test]
fn a_missing_device_or_a_tree_without_pci_is_a_clear_error() {
    let root = tempfile::tempdir().unwrap();
    let e = place(root.path(), "0000:99:00.0").unwrap_err().to_string();
    assert!(e.contains("0000:99:00.0"), "{e}");
    assert!(find(root.path(), DeviceKind::Nvme).unwrap().is_empty());
    let m = Matrix::of(root.path(), &[], &[]).unwrap();
    assert!(m.to_string().contains("no pair to classify"));
    // A GPU and no controller (the lent GPU machine): the GPU's place is still printed.
    let (gpus, _) = dgx(root.path());
    let text = Matrix::of(root.path(), &gpus[..1], &[])
        .unwrap()
        .to_string();
    assert!(text.contains("1 GPU(s), 0 NVMe controller(s)"), "{text}");
    assert!(
        text.contains(&format!("GPU {} under host bridge pci", gpus[0])),
        "{text}"
    );
}

#[test]
fn peer_to_peer_is_judged_per_pair_one_gpu_near_and_far() {
    let root = tempfile::tempdir().unwrap();
    let (gpus, nvmes) = dgx(root.path());
    // GPU 0 against every drive: the two behind its switch and the two under the other host
    // bridge of its socket are tried for vfio-p2p; the four on the other socket are not.
    for (c, nvme) in nvmes.iter().enumerate() {
        let class = pair_class(root.path(), &gpus[0], nvme).unwrap();
        let verdict = p2p_verdict(class);
        if c < 4 {
            assert!(verdict.is_ok(), "GPU 0 to NVMe {c} ({class}): {verdict:?}");
        } else {
            assert_eq!(class, PathClass::Sys);
            let why = verdict.unwrap_err();
            assert!(why.contains("different sockets (SYS)"), "{why}");
        }
    }
    // The same drive from a GPU of each socket: one verdict each.
    assert!(p2p_verdict(pair_class(root.path(), &gpus[7], &nvmes[7]).unwrap()).is_ok());
    assert!(p2p_verdict(pair_class(root.path(), &gpus[0], &nvmes[7]).unwrap()).is_err());
    // A device sysfs does not have is an error naming it, not a guess.
    let e = pair_class(root.path(), &gpus[0], "0000:ff:00.0").unwrap_err();
    assert!(e.to_string().contains("0000:ff:00.0"), "{e}");
}
