//! Embedders' GPU calls (gpunvme::handle, which the Python package and the C ABI call): file
//! bytes read into GPU memory the GPU queues did not allocate, and files written from it.

use super::*;
use blockfs::{FileSystem, NvmeBlockDevice, NvmeDeviceOptions};
use gpu_queues::GpuId;
use gpunvme::error::ErrorKind;
use gpunvme::gpu::Serving;
use gpunvme::gpu_fs::{self, GpuFsOptions};
use gpunvme::gpu_io::{self, Piece, ReadPath};
use gpunvme::handle::{DeviceHandle, SaveTensor};
use gpunvme::open::{self, DeviceSpec, OpenOptions};
use gpunvme::safetensors::{Dtype, TensorToWrite};

fn gpu_bytes(m: &DeviceMemory, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    m.read(0, &mut v).expect("GPU memory read");
    v
}

fn kind(r: gpunvme::Result<impl std::fmt::Debug>) -> ErrorKind {
    r.expect_err("an error").kind()
}

/// Reads straight into memory allocated elsewhere (whole file, an odd offset with the file
/// ending first, refusals), saves host and GPU pieces as one file (checksum recorded, an
/// existing name refused, then replaced with force), saves tensors as a .safetensors file
/// that loads back byte for byte, keeps the GPU queues between calls; then the staged read
/// path (transports that cannot map such memory) on the same file.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn foreign_gpu_memory_reads_and_writes_files() {
    let path = image("embed");
    let opts = OpenOptions {
        lba_size: 4096,
        controller_threads: 2,
        controller_queue_pairs: 8,
        ..OpenOptions::default()
    };
    let spec = path.to_str().expect("UTF-8 path").to_owned();
    let dev = DeviceHandle::open(Some(&spec), opts.clone(), 1).expect("open");
    dev.mkfs(4096, true, None).expect("mkfs");
    let data = files::data(7, (3 << 20) + 123);
    let host = path.with_extension("src");
    std::fs::write(&host, &data).expect("host file");
    dev.put(&host, "m/data", false).expect("put");
    let _ = std::fs::remove_file(&host);
    let cuda = Cuda::open(0).expect("GPU");
    let d = Serving::Device;

    let dst = Arc::new(DeviceMemory::alloc(&cuda, data.len()).expect("alloc"));
    let r = dev
        .read_into("m/data", 0, dst.clone(), d, None)
        .expect("read_into");
    assert_eq!(r.bytes, data.len() as u64);
    assert!(!r.staged, "{}", r.data_path);
    assert!(gpu_bytes(&dst, data.len()) == data, "whole file");
    assert!(dev.gpu_kept(), "the queues stay up for the next call");
    let q = dev
        .gpu_queues(&GpuId::default())
        .expect("queues for the caller's kernels");
    assert!(q.count >= 1 && q.depth.is_power_of_two(), "{q:?}");
    assert_eq!((q.nsid, q.lba_size), (1, 4096));
    let mapped = dev.gpu_map(dst.clone()).expect("map");
    assert!(
        mapped.bus() != 0 && mapped.len() == data.len(),
        "{mapped:?}"
    );
    drop(mapped);
    let gf = dev
        .gpu_file("m/data", &GpuId::default())
        .expect("the file's table for kernels");
    assert!(gf.size() == data.len() as u64 && gf.table_ptr() != 0 && !gf.is_writable());
    assert_eq!(
        kind(dev.gpu_file("m/none", &GpuId::default())),
        ErrorKind::NotFound
    );
    drop(gf);

    let tail = Arc::new(DeviceMemory::alloc(&cuda, 1 << 20).expect("alloc"));
    let off = data.len() - 5003;
    let r = dev.read_into("m/data", off as u64, tail.clone(), d, None);
    assert_eq!(r.expect("short read").bytes, 5003);
    assert!(
        gpu_bytes(&tail, 5003) == data[off..],
        "the file's last bytes"
    );
    let past = data.len() as u64 + 1;
    let e = kind(dev.read_into("m/data", past, tail.clone(), d, None));
    assert_eq!(e, ErrorKind::InvalidArgument);
    let e = kind(dev.read_into("m/none", 0, tail.clone(), d, None));
    assert_eq!(e, ErrorKind::NotFound);

    let pieces = vec![Piece::Host(b"head".to_vec()), Piece::Gpu(dst.clone())];
    let w = dev.save("m/saved", pieces, false, d, None).expect("save");
    let mut want = b"head".to_vec();
    want.extend_from_slice(&data);
    assert_eq!(w.bytes, want.len() as u64);
    assert_eq!(w.crc32c, Some(format!("{:08x}", crc32c::crc32c(&want))));
    let mut back = vec![0u8; want.len() + 10];
    assert_eq!(
        dev.read_at("m/saved", 0, &mut back).expect("read"),
        want.len()
    );
    assert!(
        back[..want.len()] == want[..],
        "saved bytes read back by the CPU"
    );
    let fsck = dev.fsck(false, true).expect("fsck");
    assert!(
        fsck.consistent && fsck.mismatched.is_empty(),
        "{}",
        fsck.json
    );
    let one = || vec![Piece::Host(b"x".to_vec())];
    assert_eq!(
        kind(dev.save("m/saved", one(), false, d, None)),
        ErrorKind::Exists
    );
    dev.save("m/saved", one(), true, d, None).expect("replace");
    let mut b = [0u8; 4];
    assert_eq!(dev.read_at("m/saved", 0, &mut b).expect("read"), 1);
    assert_eq!(b[0], b'x');

    let a: Vec<u8> = (0..24u8).collect();
    let am = Arc::new(DeviceMemory::alloc(&cuda, a.len()).expect("alloc"));
    am.write(0, &a).expect("write");
    let bm = Arc::new(DeviceMemory::alloc(&cuda, 3).expect("alloc"));
    bm.write(0, &[7, 8, 9]).expect("write");
    let t = |name: &str, dtype, shape: Vec<u64>, bytes, mem| SaveTensor {
        info: TensorToWrite {
            name: name.into(),
            dtype,
            shape,
            bytes,
        },
        mem,
    };
    let meta = [("format".to_string(), "pt".to_string())].into();
    let tensors = vec![
        t("a", Dtype::F32, vec![2, 3], 24, Some(am.clone())),
        t("b", Dtype::I8, vec![3], 3, Some(bm.clone())),
        t("e", Dtype::F16, vec![0], 0, None),
    ];
    dev.save_safetensors("m/t.safetensors", tensors, &meta, false, d, None)
        .expect("save_safetensors");
    let (loaded, report) = dev
        .load_safetensors("m/t.safetensors", &GpuId::default(), d, None)
        .expect("load back");
    // On the software controller the arena was allocated beside the queues' set-up.
    let beside = report["phases"]["arena_beside_setup"]
        .as_f64()
        .unwrap_or(0.0);
    assert!(beside > 0.0, "{}", report["phases"]);
    let mut seen = 0;
    for p in &loaded.tensors {
        let mut v = vec![0u8; p.info.bytes() as usize];
        loaded.arena.read(p.offset as usize, &mut v).expect("arena");
        let want: &[u8] = match p.info.name.as_str() {
            "a" => &a,
            "b" => &[7, 8, 9],
            "e" => &[],
            other => panic!("unexpected tensor {other}"),
        };
        assert_eq!(v, want, "{}", p.info.name);
        seen += 1;
    }
    assert_eq!(seen, 3);
    // A tensor whose memory is not its shape's size: refused, nothing written.
    let bad = vec![t("a", Dtype::F32, vec![2, 4], 32, Some(am.clone()))];
    let e = kind(dev.save_safetensors("m/bad.safetensors", bad, &meta, false, d, None));
    assert_eq!(e, ErrorKind::InvalidArgument);
    assert!(dev.stat("m/bad.safetensors").is_err(), "nothing written");
    // The GPU-resident model maps such memory too (its windows are GPU pointers); an odd
    // length, so the mapping ends inside a page. Started for the call, stopped after it.
    let model = Serving::Model(MediaKind::Hbm);
    let whole = Arc::new(DeviceMemory::alloc(&cuda, 64 << 10).expect("alloc"));
    // Starting 512 bytes into a page, as a framework's small tensors do.
    #[allow(unsafe_code)]
    // SAFETY: bytes 512..10_513 of `whole`, an allocation the borrowed value keeps alive
    // (`keep`); nothing else frees it.
    let odd = unsafe {
        DeviceMemory::borrowed(&cuda, whole.ptr() + 512, 10_001, Box::new(whole.clone()))
    };
    let odd = Arc::new(odd.expect("borrow"));
    let r = dev.read_into("m/data", 3, odd.clone(), model, None);
    assert_eq!(r.expect("model read_into").bytes, 10_001);
    assert!(
        gpu_bytes(&odd, 10_001) == data[3..10_004],
        "bytes through the model"
    );
    assert!(!dev.gpu_kept(), "the model is not kept between calls");
    dev.release_gpu().expect("release");
    assert!(!dev.gpu_kept());
    drop(dev);

    // The staged path, on the same file.
    let spec = DeviceSpec::parse(Some(&spec)).expect("spec");
    let (ctrl, backend) = open::open_controller_and_transport(&spec, &opts).expect("open");
    let dev_opts = NvmeDeviceOptions::default();
    let blk = NvmeBlockDevice::new(&ctrl, 1, &dev_opts).expect("block device");
    let fs = FileSystem::mount(Arc::new(blk)).expect("mount");
    let gopts = GpuFsOptions {
        cpu_queues: dev_opts.queues as u16,
        ..GpuFsOptions::default()
    };
    let (_cuda, setup) = gpu_fs::setup(&ctrl, &backend, &gopts).expect("GPU queues");
    let staged = Arc::new(DeviceMemory::alloc(&cuda, data.len()).expect("alloc"));
    let r = gpu_io::read_into(&setup, &fs, "m/data", 0, &staged, ReadPath::Staged, || None)
        .expect("staged read");
    assert!(r.staged && r.bytes == data.len() as u64, "{r:?}");
    assert!(gpu_bytes(&staged, data.len()) == data, "staged bytes");
    gpu_fs::teardown(setup).expect("teardown");
}
