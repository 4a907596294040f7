//! GPU queues on pairs a `gpunvme serve` daemon lends (the served transport): the daemon runs
//! in this process (`gpunvme_serve::Server` over an image), the GPU client reaches it through
//! its socket like any other process would, and a CPU client on a second connection checks
//! every byte the GPU moved. With `host-gpu` the GPU threads are CPU threads and the served
//! memory is registered by identity; on a GPU, the arena and doorbell page are registered with
//! CUDA and reached over PCIe.

use super::*;

use gpunvme::served::ServedController;
use gpunvme_serve::{ServeOptions, Server};
use gpunvme_serve_client::Connection;

const LBA: u32 = 512;

/// A daemon over a fresh 64 MiB image of 512-byte blocks in `dir`.
fn daemon(dir: &std::path::Path) -> Server {
    let image = dir.join("served.img");
    EmuConfig::create_image(&image, NS_BYTES).unwrap();
    let mut opts = ServeOptions::new(
        dir.join("serve.sock"),
        vec![("nvme0".into(), image.to_str().unwrap().into())],
    );
    opts.open.controller_queue_pairs = 16;
    Server::start(opts).unwrap()
}

fn gpu_options(queues: u16) -> GpuQueueOptions {
    GpuQueueOptions {
        queues: Some(queues),
        depth: Some(64),
        slot_buffer_bytes: Some(128 << 10),
        ..Default::default()
    }
}

/// Bytes of each CPU client command (at most the controller's maximum transfer).
const CPU_CHUNK: usize = 128 << 10;

/// A CPU client's pair on its own connection, for checking what GPU threads moved.
fn cpu_client(socket: &std::path::Path) -> (Connection, gpunvme_serve_client::QueuePair) {
    let conn = Connection::connect(socket, "cpu-checker", Duration::from_secs(10)).unwrap();
    let arena = Arc::new(
        conn.alloc_arena(
            "nvme0",
            gpunvme_serve_client::layout::arena_bytes_for(1, 16, CPU_CHUNK as u32),
        )
        .unwrap(),
    );
    let pair = conn
        .create_queues("nvme0", &arena, 1, 16, CPU_CHUNK as u32)
        .unwrap()
        .remove(0);
    (conn, pair)
}

fn cpu_read(pair: &mut gpunvme_serve_client::QueuePair, slba: u64, blocks: u64) -> Vec<u8> {
    let mut out = vec![0u8; (blocks * LBA as u64) as usize];
    for (i, chunk) in out.chunks_mut(CPU_CHUNK).enumerate() {
        let lba = slba + (i * CPU_CHUNK / LBA as usize) as u64;
        let n = (chunk.len() / LBA as usize) as u32;
        pair.read(1, lba, n, LBA, chunk).unwrap();
    }
    out
}

fn cpu_write(pair: &mut gpunvme_serve_client::QueuePair, slba: u64, data: &[u8]) {
    for (i, chunk) in data.chunks(CPU_CHUNK).enumerate() {
        let lba = slba + (i * CPU_CHUNK / LBA as usize) as u64;
        let n = (chunk.len() / LBA as usize) as u32;
        pair.write(1, lba, n, LBA, chunk).unwrap();
    }
}

/// The client entries of the daemon's status that hold queues.
fn clients_holding_queues(server: &Server) -> usize {
    let st = server.daemon().status();
    st["clients"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| !c["queues"].as_array().unwrap().is_empty())
        .count()
}

/// Every transfer shape (PRP1 only, PRP1 + PRP2, a list, the slot size, above it: split)
/// written by GPU threads through served queues and read back by a CPU client of the same
/// daemon, and the reverse; a read past the namespace fails with the controller's status.
pub(super) fn served_gpu_queues_carry_every_shape_beside_a_cpu_client() {
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path());
    let served = ServedController::connect(server.socket(), None, "gpu-client").unwrap();
    let gpu = served.gpu_queues(&cuda(), &gpu_options(2)).unwrap();
    assert_eq!(gpu.transport(), gpu_queues::TransportKind::Served);
    let (_conn, mut cpu) = cpu_client(server.socket());
    let buf = gpu.alloc_buffer(4 << 20).unwrap();
    let mdts = gpu.max_transfer() as u64;
    let shapes = [
        (0u64, LBA as u64),
        (4096 - LBA as u64, 2 * LBA as u64),
        (0, 8192),
        (LBA as u64, 64 << 10),
        (0, 128 << 10),
        (0, 3 * (128 << 10) + 4 * LBA as u64),
        (4096 + 4, mdts.min(1 << 20)),
    ];
    for (i, &(off, bytes)) in shapes.iter().enumerate() {
        for warp in [false, true] {
            let blocks = bytes / LBA as u64;
            let slba = 1 + i as u64 * ((4 << 20) / LBA as u64);
            let data = pattern(slba + warp as u64, blocks, LBA);
            buf.memory().write(off as usize, &data).unwrap();
            let (s, sf) = rw_on_queues(
                &gpu,
                LBA,
                gpu.descriptors(),
                true,
                slba,
                blocks,
                buf.bus() + off,
                warp,
            );
            assert_eq!(
                (s, sf),
                (DeviceStatus::Ok, 0),
                "GPU write, shape {i} warp={warp}"
            );
            assert!(
                cpu_read(&mut cpu, slba, blocks) == data,
                "shape {i} warp={warp}: the CPU client reads what GPU threads wrote"
            );
            let other = pattern(slba + 100, blocks, LBA);
            cpu_write(&mut cpu, slba, &other);
            buf.memory()
                .write(off as usize, &vec![0u8; bytes as usize])
                .unwrap();
            let (s, sf) = rw_on_queues(
                &gpu,
                LBA,
                gpu.descriptors(),
                false,
                slba,
                blocks,
                buf.bus() + off,
                warp,
            );
            assert_eq!(
                (s, sf),
                (DeviceStatus::Ok, 0),
                "GPU read, shape {i} warp={warp}"
            );
            let mut back = vec![0u8; bytes as usize];
            buf.memory().read(off as usize, &mut back).unwrap();
            assert!(
                back == other,
                "shape {i} warp={warp}: GPU threads read what the CPU client wrote"
            );
        }
    }
    let end = NS_BYTES / LBA as u64;
    let (s, sf) = rw_on_queues(
        &gpu,
        LBA,
        gpu.descriptors(),
        false,
        end - 1,
        2,
        buf.bus(),
        false,
    );
    assert_eq!(s, DeviceStatus::NvmeError, "a read past the namespace");
    assert_ne!(sf, 0, "the controller's status field");
    let st = server.daemon().status();
    assert_eq!(st["controllers"][0]["invalid_doorbell_writes"], 0, "{st}");
}

/// Many requests in flight on every served queue at once (more than the rings hold, so they
/// wrap), from two GPU clients on one daemon each on its own range; then each client's queues
/// dropped: its pairs and arenas go back to the daemon while the other keeps working.
pub(super) fn served_gpu_queues_go_back_to_the_daemon_and_two_gpu_clients_share_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path());
    let a = ServedController::connect(server.socket(), Some("nvme0"), "gpu-a").unwrap();
    let b = ServedController::connect(server.socket(), Some("nvme0"), "gpu-b").unwrap();
    let ga = a.gpu_queues(&cuda(), &gpu_options(4)).unwrap();
    let gb = b.gpu_queues(&cuda(), &gpu_options(2)).unwrap();
    assert_eq!(clients_holding_queues(&server), 2);
    let (_conn, mut cpu) = cpu_client(server.socket());
    // 256 requests of 8 blocks per client over its 4 queues of depth 64: every ring wraps.
    let blocks = 8u64;
    let per = 256u64;
    for (k, g) in [&ga, &gb].into_iter().enumerate() {
        let first = 1 + k as u64 * per * blocks;
        let buf = g
            .alloc_buffer((per * blocks) as usize * LBA as usize)
            .unwrap();
        let data = pattern(first, per * blocks, LBA);
        buf.memory().write(0, &data).unwrap();
        // 8 blocks of 512 bytes are one page at a page boundary: PRP1 only.
        let reqs: Vec<IoReq> = (0..per)
            .map(|i| IoReq {
                slba: first + i * blocks,
                prp1: buf.bus() + i * blocks * LBA as u64,
                prp2: 0,
                nsid: 1,
                nlb_z: (blocks - 1) as u16,
                opcode: 0x01,
                reserved: 0,
            })
            .collect();
        let batch = IoBatch::new(g.cuda(), &reqs).unwrap();
        batch
            .launch(
                g.kernels(),
                g.client_stream(),
                g.descriptors(),
                g.len() as u32,
                k == 1,
            )
            .unwrap();
        g.client_stream().wait_idle(compute_wait_bound()).unwrap();
        let results = batch.results().unwrap();
        assert!(
            results
                .iter()
                .all(|&(s, sf)| s == DeviceStatus::Ok && sf == 0),
            "client {k}: {:?}",
            results.iter().find(|r| r.0 != DeviceStatus::Ok)
        );
        assert!(
            cpu_read(&mut cpu, first, per * blocks) == data,
            "client {k}'s bytes"
        );
    }
    drop(ga);
    assert_eq!(
        clients_holding_queues(&server),
        2,
        "a's pairs went back (b and the CPU checker hold theirs)"
    );
    // b still works after a's queues were deleted.
    let buf = gb.alloc_buffer(4096).unwrap();
    let (s, _) = rw_on_queues(&gb, LBA, gb.descriptors(), false, 1, 8, buf.bus(), false);
    assert_eq!(s, DeviceStatus::Ok);
    let mut back = vec![0u8; 4096];
    buf.memory().read(0, &mut back).unwrap();
    assert!(back == pattern(1, 8, LBA), "b reads a's bytes after a went");
    drop(buf);
    drop(gb);
    assert_eq!(
        clients_holding_queues(&server),
        1,
        "only the CPU checker holds queues"
    );
    let st = server.daemon().status();
    let arenas: Vec<u64> = st["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["arena_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(
        arenas.iter().filter(|&&b| b > 0).count(),
        1,
        "GPU clients' arenas freed: {st}"
    );
    assert_eq!(st["late_controller_writes"], 0, "{st}");
    assert_eq!(st["late_controller_reads"], 0, "{st}");
}

/// `gpunvme serve check --gpu` against the in-process daemon: the binary this suite was built
/// with (host-gpu in CI: its GPU threads are CPU threads of the client process).
fn gpu_check_cmd(socket: &std::path::Path, extra: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_gpunvme"));
    c.args(["serve", "--socket"])
        .arg(socket)
        .args([
            "check", "--gpu", "--lbas", "16384", "--queues", "2", "--depth", "64", "--qd", "8",
            "--seed", "77",
        ])
        .args(extra)
        .env("GPUNVME_HOST_GPU_THREADS", "32")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    c
}

/// GPU client processes killed with SIGKILL at random points (during queue creation, mid-I/O
/// with commands outstanding) while another GPU client process verifies the same range: the
/// daemon lives, reclaims every dead client's queues and memory (none reached by the
/// controller afterwards), and the verifier reads the pattern throughout with 0 errors.
pub(super) fn served_gpu_clients_killed_at_random_points_are_reclaimed() {
    use rand::{Rng, SeedableRng};
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path());
    let socket = server.socket().to_path_buf();
    // Fill the range with the pattern (a whole check: write pass and read pass).
    let out = gpu_check_cmd(&socket, &[]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let iterations: u32 = std::env::var("GPUNVME_TEST_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    // The verifier reads for about as long as the kills take (at most 0.4 s each plus the
    // reclaim), then exits with its verdict.
    let runtime = format!("{}s", 4 + iterations / 2);
    let verifier = gpu_check_cmd(&socket, &["--read-only", "--json", "--runtime", &runtime])
        .spawn()
        .unwrap();
    let mut verifier = KillOnDrop(Some(verifier));
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6b11);
    for i in 0..iterations {
        // Writers of the same seed write the same bytes: the verifier's reads stay exact.
        let args: &[&str] = if i % 2 == 0 {
            &[]
        } else {
            &["--read-only", "--runtime", "30s"]
        };
        let mut child = KillOnDrop(Some(gpu_check_cmd(&socket, args).spawn().unwrap()));
        std::thread::sleep(Duration::from_millis(rng.random_range(0..400)));
        let pid = child.pid();
        child.kill();
        // Reclaimed within a bound: the dead client's entry leaves the status.
        let t = Instant::now();
        loop {
            let st = server.daemon().status();
            let alive = st["clients"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["pid"].as_u64() == Some(pid));
            if !alive {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "client {pid} never reclaimed: {st}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let out = verifier.wait_output(Duration::from_secs(120));
    assert!(
        out.status.success(),
        "the verifier beside the kills: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["read"]["ios"].as_u64().unwrap() > 0, "{v}");
    let out = gpu_check_cmd(&socket, &["--read-only", "--ios", "4000"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "after the kills: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let st = server.daemon().status();
    assert_eq!(st["late_controller_writes"], 0, "{st}");
    assert_eq!(st["late_controller_reads"], 0, "{st}");
    assert_eq!(st["controllers"][0]["lent_queue_pairs"], 0, "{st}");
    assert!(st["controllers"][0]["degraded"].is_null(), "{st}");
}

/// A child process killed when dropped (a failed assertion must not leave it running).
struct KillOnDrop(Option<std::process::Child>);

impl KillOnDrop {
    fn pid(&self) -> u64 {
        self.0.as_ref().map_or(0, |c| u64::from(c.id()))
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Its exit and output, waited for at most `bound` (then killed: a failure).
    fn wait_output(&mut self, bound: Duration) -> std::process::Output {
        let mut c = self.0.take().expect("a child");
        let t = Instant::now();
        while c.try_wait().unwrap().is_none() {
            if t.elapsed() > bound {
                let _ = c.kill();
                panic!("the child ran past {bound:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        c.wait_with_output().unwrap()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `.safetensors` file of `tensors` (name, F32 values).
fn safetensors_bytes(tensors: &[(&str, Vec<f32>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, v) in tensors {
        let start = data.len();
        data.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": "F32", "shape": [v.len()], "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

/// blockfs (4 KiB blocks) made on image `imgs` with `files` put (host path, name) by a process
/// owning it, then a daemon serving it from `dir`: the daemon and its `served:` spec.
fn serve_files(
    dir: &std::path::Path,
    imgs: &str,
    files: &[(&std::path::Path, &str)],
) -> (Server, String) {
    use gpunvme::handle::DeviceHandle;
    use gpunvme::open::OpenOptions;
    let owner = DeviceHandle::open(Some(imgs), OpenOptions::default(), 1).unwrap();
    owner.mkfs(4096, false, None).unwrap();
    for (path, name) in files {
        owner.put(path, name, false).unwrap();
    }
    owner.close();
    let mut opts = ServeOptions::new(dir.join("serve.sock"), vec![("nvme0".into(), imgs.into())]);
    opts.open.controller_queue_pairs = 16;
    let server = Server::start(opts).unwrap();
    let spec = format!("served:{}", server.socket().display());
    (server, spec)
}

/// A served device through the library's handle (`served:SOCKET`, what Python and C open):
/// `load_safetensors` by this process's CPU on lent queues puts every tensor's bytes in the arena,
/// two handles at once; `save_safetensors` from GPU memory goes through the daemon's write lease
/// and loads back byte for byte on the other handle; mkfs is refused as the operator's.
pub(super) fn served_device_loads_safetensors_through_the_handle() {
    use gpunvme::gpu::Serving;
    use gpunvme::handle::DeviceHandle;
    use gpunvme::open::OpenOptions;
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("st.img");
    EmuConfig::create_image(&image, NS_BYTES).unwrap();
    let imgs = image.to_str().unwrap();
    let tensors: Vec<(&str, Vec<f32>)> = vec![
        ("a", (0..1000).map(|i| i as f32 * 0.5).collect()),
        ("b", (0..70_001).map(|i| (i as f32).sin()).collect()),
        ("c", vec![7.0; 3]),
    ];
    let file = dir.path().join("m.safetensors");
    std::fs::write(&file, safetensors_bytes(&tensors)).unwrap();
    let (server, spec) = serve_files(dir.path(), imgs, &[(&file, "m.safetensors")]);
    // The first handle leaves the issuer to the size (this small model: the CPU), the
    // second asks for GPU threads, whatever GPUNVME_SERVED_READS says.
    use gpunvme::open::ServedReads;
    let handles: Vec<DeviceHandle> = [ServedReads::Auto, ServedReads::Gpu]
        .into_iter()
        .map(|served_reads| {
            let opts = OpenOptions {
                served_reads,
                ..OpenOptions::default()
            };
            DeviceHandle::open(Some(&spec), opts, 1).unwrap()
        })
        .collect();
    for (i, h) in handles.iter().enumerate() {
        assert!(h.is_served(), "{}", h.describe());
        let (loaded, report) = h
            .load_safetensors("m.safetensors", &Default::default(), Serving::Device, None)
            .unwrap();
        assert!(
            report["transport"].as_str().unwrap().starts_with("served"),
            "{report}"
        );
        let cpu = report["data_path"]
            .as_str()
            .unwrap()
            .starts_with("a CPU thread");
        assert_eq!(
            cpu,
            i == 0,
            "handle {i}: who issued the served load's reads: {report}"
        );
        assert_eq!(loaded.tensors.len(), 3);
        for p in &loaded.tensors {
            let want: Vec<u8> = tensors
                .iter()
                .find(|(n, _)| *n == p.info.name)
                .unwrap()
                .1
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            let mut got = vec![0u8; want.len()];
            loaded.arena.read(p.offset as usize, &mut got).unwrap();
            assert!(
                loaded.arena.buffer().is_none(),
                "a served load's tensors are in GPU memory, staged"
            );
            assert!(got == want, "tensor {}: bytes differ", p.info.name);
        }
    }
    // A save from GPU memory through the daemon's write lease, loaded back by the other
    // handle byte for byte; an existing name needs force; mkfs is the operator's.
    let cuda = Cuda::open(0).unwrap();
    let bytes: Vec<u8> = (0..300_007u32).map(|i| (i * 7 + 3) as u8).collect();
    let mem = Arc::new(gpu_queues::ffi::DeviceMemory::alloc(&cuda, bytes.len()).unwrap());
    mem.write(0, &bytes).unwrap();
    let save = |force| {
        handles[0].save_safetensors(
            "n.safetensors",
            vec![gpunvme::handle::SaveTensor {
                info: gpunvme::safetensors::TensorToWrite {
                    name: "u".into(),
                    dtype: gpunvme::safetensors::Dtype::U8,
                    shape: vec![bytes.len() as u64],
                    bytes: bytes.len() as u64,
                },
                mem: Some(mem.clone()),
            }],
            &Default::default(),
            force,
            Serving::Device,
            None,
        )
    };
    let r = save(false).unwrap();
    assert!(
        r.crc32c.is_some() && r.data_path.contains("write lease"),
        "{r:?}"
    );
    assert_eq!(save(false).unwrap_err().kind(), gpunvme::ErrorKind::Exists);
    save(true).unwrap();
    let (loaded, _) = handles[1]
        .load_safetensors("n.safetensors", &Default::default(), Serving::Device, None)
        .unwrap();
    let p = &loaded.tensors[0];
    let mut got = vec![0u8; bytes.len()];
    loaded.arena.read(p.offset as usize, &mut got).unwrap();
    assert!(got == bytes, "the saved tensor's bytes differ");
    let e = handles[0].mkfs(4096, true, None).unwrap_err();
    assert_eq!(e.kind(), gpunvme::ErrorKind::ReadOnly, "{e}");
    assert_eq!(handles[1].ls("").unwrap().0.len(), 2);
    drop((loaded, handles));
    let st = server.daemon().status();
    assert_eq!(st["controllers"][0]["lent_queue_pairs"], 0, "{st}");
    assert_eq!(st["late_controller_writes"], 0, "{st}");
}

/// Reads on a served device land in GPU memory through the bounce buffer the daemon lends
/// (`gpunvme::staged`): `read_into` a GPU allocation of a file of three windows and more at an
/// unaligned offset, and `fs get --gpu` of it with the GPU's CRC-32C equal to the host's; the
/// tensors of a load are in GPU memory the controller never reached.
pub(super) fn served_reads_are_staged_into_gpu_memory() {
    use gpunvme::gpu::Serving;
    use gpunvme::handle::DeviceHandle;
    use gpunvme::open::OpenOptions;
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("big.img");
    EmuConfig::create_image(&image, 128 << 20).unwrap();
    let imgs = image.to_str().unwrap();
    // Three windows of gpunvme::staged::WINDOW_BYTES and a tail.
    let len = 2 * gpunvme::staged::WINDOW_BYTES as usize + (5 << 20) + 12_345;
    let mut data = vec![0u8; len];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let src = dir.path().join("big.bin");
    std::fs::write(&src, &data).unwrap();
    let (server, spec) = serve_files(dir.path(), imgs, &[(&src, "big.bin")]);
    let cuda = Cuda::open(0).unwrap();
    let offset = 4097u64;
    let n = len - offset as usize - 3;
    // Issued by this process's CPU and by GPU threads (the handle's choice).
    let mut h = None;
    for served_reads in [
        gpunvme::open::ServedReads::Cpu,
        gpunvme::open::ServedReads::Gpu,
    ] {
        let opts = OpenOptions {
            served_reads,
            ..OpenOptions::default()
        };
        let handle = DeviceHandle::open(Some(&spec), opts, 1).unwrap();
        let dst = Arc::new(DeviceMemory::alloc(&cuda, n).unwrap());
        let report = handle
            .read_into("big.bin", offset, dst.clone(), Serving::Device, None)
            .unwrap();
        assert!(report.staged, "{report:?}");
        assert_eq!(report.bytes, n as u64);
        assert_eq!(
            report.data_path.starts_with("a CPU thread"),
            served_reads == gpunvme::open::ServedReads::Cpu,
            "{served_reads:?}: {report:?}"
        );
        let mut got = vec![0u8; n];
        dst.read(0, &mut got).unwrap();
        assert!(
            got == data[offset as usize..offset as usize + n],
            "{served_reads:?}: read_into bytes differ"
        );
        h = Some(handle);
    }
    let h = h.unwrap();
    // fs get --gpu: the file into GPU memory, checksummed there.
    let served =
        ServedController::open(&gpunvme::served::ServedSpec::parse(&spec).unwrap(), "get").unwrap();
    let fs = h.mount().unwrap();
    let got = gpunvme::gpu_fs::get(
        gpunvme::gpu_fs::QueueSource::Served(&served),
        &fs,
        "big.bin",
        &Default::default(),
    )
    .unwrap();
    assert_eq!(got.bytes, len as u64);
    assert_eq!(got.gpu_crc32c, got.host_crc32c);
    assert!(got.data_path.contains("bounce"), "{}", got.data_path);
    drop((served, fs, h));
    let st = server.daemon().status();
    assert_eq!(st["controllers"][0]["lent_queue_pairs"], 0, "{st}");
    assert_eq!(st["late_controller_writes"], 0, "{st}");
}

/// A served load's reads issued by this process's CPU (`gpunvme::cpu_staged`): 300 ranges of
/// a 40 MiB file at random offsets and lengths (inside one LBA, across LBAs, across windows,
/// several MiB) into GPU memory through the lent bounce, each range's bytes exactly the
/// file's; a range past the end of the file and a destination too small are refused by name.
pub(super) fn served_cpu_reads_cover_many_windows_and_odd_shapes() {
    use gpunvme::cpu_staged::{CpuIo, Windows, read_staged_cpu};
    use gpunvme::handle::DeviceHandle;
    use gpunvme::open::OpenOptions;
    use gpunvme::staged::StagedRead;
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("big.img");
    EmuConfig::create_image(&image, 128 << 20).unwrap();
    let len = (40 << 20) + 777usize;
    let mut data = vec![0u8; len];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for chunk in data.chunks_mut(8) {
        chunk.copy_from_slice(&next().to_le_bytes()[..chunk.len()]);
    }
    let src = dir.path().join("big.bin");
    std::fs::write(&src, &data).unwrap();
    let (server, spec) = serve_files(dir.path(), image.to_str().unwrap(), &[(&src, "big.bin")]);
    let h = DeviceHandle::open(Some(&spec), OpenOptions::default(), 1).unwrap();
    let fs = h.mount().unwrap();
    let table = fs
        .open("big.bin", blockfs::OpenMode::ReadOnly)
        .unwrap()
        .extent_table()
        .unwrap();
    let served =
        ServedController::open(&gpunvme::served::ServedSpec::parse(&spec).unwrap(), "cpu").unwrap();
    let mut pairs = served.cpu_pairs(3, 16, 4096).unwrap();
    let mut reads = Vec::new();
    let mut dest = 0u64;
    for i in 0..300u64 {
        let n = match i % 5 {
            0 => 1 + next() % 300,
            1 => 1 + next() % 5000,
            2 => 1 + next() % (200 << 10),
            3 => (next() % 4 + 1) * 4096,
            _ => 1 + next() % (3 << 20),
        };
        let offset = next() % (len as u64 - n);
        reads.push(StagedRead {
            file: 0,
            offset,
            len: n,
            dest,
        });
        dest += n + next() % 64;
    }
    // The file's last byte, and its first LBA whole.
    reads.push(StagedRead {
        file: 0,
        offset: len as u64 - 1,
        len: 1,
        dest,
    });
    reads.push(StagedRead {
        file: 0,
        offset: 0,
        len: 512,
        dest: dest + 1,
    });
    let total = dest + 513;
    let cuda = Cuda::open(0).unwrap();
    let out = Arc::new(DeviceMemory::alloc(&cuda, total as usize).unwrap());
    let bytes: u64 = reads.iter().map(|r| r.len).sum();
    // Small windows (64 KiB): many of them, and reads longer than a window.
    let windows = Windows {
        count: 3,
        bytes: 64 << 10,
    };
    let bounce = served
        .lend_host(windows.bounce_bytes(bytes) as usize)
        .unwrap();
    let window = bounce.arena().len() as usize / windows.count;
    let info = served.info().clone();
    let run = |pairs: &mut [gpunvme_serve_client::QueuePair],
               reads: &[StagedRead],
               dest: &Arc<DeviceMemory>| {
        let io = CpuIo {
            pairs,
            nsid: 1,
            lba_size: LBA,
            max_transfer: info.max_transfer_bytes,
            bounce: bounce.arena(),
            windows: windows.count,
        };
        // Each window registered when first copied from, as the library's registrar does.
        let window_memory = |s: usize| {
            let reg = gpu_queues::ffi::os::SharedRegistration::register_range(
                &cuda,
                bounce.arena().mem.clone(),
                s * window,
                window,
            )
            .unwrap();
            Ok(Arc::new(
                Arc::new(reg).as_device_memory(&cuda, 0, window).unwrap(),
            ))
        };
        read_staged_cpu(
            io,
            &[table.table()],
            reads,
            || Ok(dest.clone()),
            window_memory,
            || None,
        )
    };
    let outcome = run(&mut pairs.pairs, &reads, &out).unwrap();
    assert_eq!(outcome.bytes, bytes);
    assert!(outcome.windows > 100, "{outcome:?}");
    let mut got = vec![0u8; total as usize];
    out.read(0, &mut got).unwrap();
    for r in &reads {
        let (o, d, n) = (r.offset as usize, r.dest as usize, r.len as usize);
        assert!(
            got[d..d + n] == data[o..o + n],
            "{n} bytes from file byte {o} at destination byte {d} differ"
        );
    }
    // Past the end of the file; a destination too small for a read: refused, nothing sent.
    let past = [StagedRead {
        file: 0,
        offset: len as u64 - 10,
        len: 11,
        dest: 0,
    }];
    let e = run(&mut pairs.pairs, &past, &out).unwrap_err();
    assert_eq!(e.kind(), gpunvme::ErrorKind::InvalidArgument, "{e}");
    let small = Arc::new(DeviceMemory::alloc(&cuda, 100).unwrap());
    let over = [StagedRead {
        file: 0,
        offset: 5,
        len: 20,
        dest: 90,
    }];
    let e = run(&mut pairs.pairs, &over, &small).unwrap_err();
    assert_eq!(e.kind(), gpunvme::ErrorKind::InvalidArgument, "{e}");
    assert!(pairs.pairs.iter().all(|p| p.in_flight() == 0));
    drop((pairs, bounce, served, fs, h));
    let st = server.daemon().status();
    assert_eq!(st["controllers"][0]["lent_queue_pairs"], 0, "{st}");
    assert_eq!(st["late_controller_writes"], 0, "{st}");
}

/// The page cache (`gpu_cache`) over a served device's GPU queues: a fragmented file of the
/// daemon's blockfs read through the cache by GPU threads under eviction, every element
/// exact (the frames in GPU memory, filled through the slot buffers, the data path Auto
/// chooses there); then a new file written by GPU stores
/// through the cache into a write lease's table, flushed, committed with its CRC-32C and read
/// back by another handle byte for byte.
pub(super) fn served_page_cache_reads_and_writes_files() {
    use blockfs::OpenMode;
    use blockfs_gpu::{GpuFiles, GpuFilesOptions};
    use gpunvme::gpu_cache::{CacheOptions, DataPath, GpuCache, bind_file};
    use gpunvme::handle::DeviceHandle;
    use gpunvme::open::OpenOptions;
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("cache.img");
    EmuConfig::create_image(&image, NS_BYTES).unwrap();
    let len = 1_200_000 + 24;
    let mut data = vec![0u8; len];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let src = dir.path().join("data.bin");
    std::fs::write(&src, &data).unwrap();
    let (server, spec) = serve_files(dir.path(), image.to_str().unwrap(), &[(&src, "data.bin")]);
    let h = DeviceHandle::open(Some(&spec), OpenOptions::default(), 1).unwrap();
    let fs = h.mount().unwrap();
    let served =
        ServedController::open(&gpunvme::served::ServedSpec::parse(&spec).unwrap(), "cache")
            .unwrap();
    let gpu = served.gpu_queues(&cuda(), &gpu_options(2)).unwrap();
    let files = GpuFiles::new(&gpu, GpuFilesOptions::default());
    let word = |bytes: &[u8], i: u64| {
        let at = i as usize * 8;
        u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
    };
    let opts = |data_path| CacheOptions {
        page_size: 16384,
        capacity: 8 * 16384,
        data_path,
        ..Default::default()
    };
    let file = fs.open("data.bin", OpenMode::ReadOnly).unwrap();
    let n = len as u64 / 8;
    let mut paths = Vec::new();
    for data_path in [DataPath::Auto, DataPath::Bounce] {
        let g = files.open(&file).unwrap();
        let mut c = GpuCache::new(&gpu, opts(data_path)).expect("a cache on served queues");
        paths.push(c.data_path());
        bind_file(&mut c, &g).unwrap();
        let mut x = 0x51u64;
        let mut idx: Vec<u64> = (0..128 * 8)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            })
            .collect();
        idx[5] = n - 1;
        for warp in [true, false] {
            let (v, st) = super::cache::access_on(&gpu, &c, warp as u32, 128, 8, &idx, None);
            for (k, &i) in idx.iter().enumerate() {
                assert_eq!(
                    DeviceStatus::from_code(st[k]),
                    DeviceStatus::Ok,
                    "{:?} warp {warp}: element {i}",
                    c.data_path()
                );
                assert_eq!(
                    v[k],
                    word(&data, i),
                    "{:?} warp {warp}: element {i}",
                    c.data_path()
                );
            }
        }
        let s = c.stats().unwrap().counters;
        assert!(s.misses > 8 && s.evictions > 0 && s.errors == 0, "{s:?}");
        c.check_invariants().unwrap();
    }
    assert_eq!(
        paths,
        [DataPath::Bounce; 2],
        "frames in GPU memory: the served queues' buffers are host memory"
    );
    // A new file through a write lease: every element stored by GPU threads through the
    // cache (read-modify-write of each page, written back on eviction and by close).
    let per = 3125u32;
    let new_len = 64 * per as u64 * 8;
    let lease = served.fs_create(1, "new.bin", new_len, false).unwrap();
    let g = files
        .open_table(lease.table().clone(), "new.bin", Arc::new(()))
        .unwrap();
    assert!(g.is_writable());
    let mut c = GpuCache::new(&gpu, opts(DataPath::Auto)).unwrap();
    bind_file(&mut c, &g).unwrap();
    drop(g);
    let m = new_len / 8;
    let idx: Vec<u64> = (0..m)
        .map(|k| (k % per as u64) * 64 + k / per as u64)
        .collect();
    let vals: Vec<u64> = idx
        .iter()
        .map(|&i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let (_, st) = super::cache::access_on(&gpu, &c, 1 | 2, 64, per, &idx, Some(&vals));
    assert!(
        st.iter()
            .all(|&s| DeviceStatus::from_code(s) == DeviceStatus::Ok),
        "stores through the cache"
    );
    let report = c.close().unwrap();
    assert!(
        report.pages_written > 0 && report.flush_cmds == 1,
        "{report:?}"
    );
    let mut want = vec![0u8; new_len as usize];
    for (&i, &v) in idx.iter().zip(&vals) {
        want[i as usize * 8..i as usize * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    lease
        .commit(new_len, Some(crc32c::crc32c(&want)))
        .expect("commit after the cache let go");
    let other = DeviceHandle::open(Some(&spec), OpenOptions::default(), 1).unwrap();
    assert!(
        other.read("new.bin", 0, None).unwrap() == want,
        "what GPU threads stored through the cache, another handle reads"
    );
    drop((gpu, file, fs, h, other, served));
    let st = server.daemon().status();
    assert_eq!(st["controllers"][0]["lent_queue_pairs"], 0, "{st}");
    assert_eq!(st["late_controller_writes"], 0, "{st}");
}
