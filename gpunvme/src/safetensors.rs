//! `.safetensors` files in blockfs loaded into GPU memory by GPU-issued reads.
//!
//! The format: an 8-byte little-endian header length, a JSON header (per tensor `dtype`,
//! `shape` and `data_offsets` into the data section, plus an optional `__metadata__` map of
//! strings), then the data section. [`read_header`] parses and checks a header on the host
//! through blockfs; [`load`] reads every tensor of one or more files into one GPU arena (each
//! tensor at a 256-byte aligned offset) with one batch of GPU file reads, so the per-tensor
//! cost is a range in a batch, not a call.

use std::sync::Arc;

use blockfs::File;
use blockfs_gpu::{FileRange, GpuFiles, GpuFilesOptions, GpuSpan};
use gpu_queues::ffi::DeviceMemory;
use gpu_queues::{GpuError, GpuQueues};
use serde_json::Value;

use crate::gpu::GpuSetup;
use crate::staged::{GpuTarget, StagedRead};

/// The largest header accepted (the format's own readers refuse more than 100 MB).
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Where tensors start in the arena: a multiple of this.
pub const ARENA_ALIGN: u64 = 256;

/// Why a file cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    /// The header is not a valid safetensors header.
    #[error("{file}: not a valid safetensors file: {why}")]
    Format {
        /// The file's name.
        file: String,
        /// What is wrong.
        why: String,
    },
    /// Two files of one load hold tensors of the same name.
    #[error("tensor {name:?} is in both {first} and {second}")]
    Duplicate {
        /// The tensor's name.
        name: String,
        /// The file that held it first.
        first: String,
        /// The file that holds it again.
        second: String,
    },
    /// blockfs failed.
    #[error(transparent)]
    Fs(#[from] blockfs::Error),
    /// A GPU read failed, or the GPU could not be used.
    #[error("loading on the GPU: {0}")]
    Gpu(String),
    /// An option or setting that cannot be used (e.g. a bad `GPUNVME_FILE_*` value).
    #[error("{0}")]
    InvalidArgument(String),
}

/// An element type of the format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// `BOOL`
    Bool,
    /// `U8`
    U8,
    /// `I8`
    I8,
    /// `F8_E4M3`
    F8E4M3,
    /// `F8_E5M2`
    F8E5M2,
    /// `U16`
    U16,
    /// `I16`
    I16,
    /// `F16`
    F16,
    /// `BF16`
    BF16,
    /// `U32`
    U32,
    /// `I32`
    I32,
    /// `F32`
    F32,
    /// `U64`
    U64,
    /// `I64`
    I64,
    /// `F64`
    F64,
}

impl Dtype {
    const ALL: [(Dtype, &'static str, u64); 15] = [
        (Dtype::Bool, "BOOL", 1),
        (Dtype::U8, "U8", 1),
        (Dtype::I8, "I8", 1),
        (Dtype::F8E4M3, "F8_E4M3", 1),
        (Dtype::F8E5M2, "F8_E5M2", 1),
        (Dtype::U16, "U16", 2),
        (Dtype::I16, "I16", 2),
        (Dtype::F16, "F16", 2),
        (Dtype::BF16, "BF16", 2),
        (Dtype::U32, "U32", 4),
        (Dtype::I32, "I32", 4),
        (Dtype::F32, "F32", 4),
        (Dtype::U64, "U64", 8),
        (Dtype::I64, "I64", 8),
        (Dtype::F64, "F64", 8),
    ];

    /// The dtype a header names, if the format has it.
    pub fn parse(s: &str) -> Option<Dtype> {
        Self::ALL.iter().find(|e| e.1 == s).map(|e| e.0)
    }

    /// Its name in headers (`"BF16"`).
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|e| e.0 == self).map_or("?", |e| e.1)
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        Self::ALL.iter().find(|e| e.0 == self).map_or(1, |e| e.2)
    }
}

/// One tensor of a header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape (empty: a scalar).
    pub shape: Vec<u64>,
    /// Its bytes in the data section: `begin..end`.
    pub begin: u64,
    /// See `begin`.
    pub end: u64,
}

impl TensorInfo {
    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.end - self.begin
    }
}

/// A parsed header.
#[derive(Clone, Debug)]
pub struct Header {
    /// The tensors, by their offset in the data section.
    pub tensors: Vec<TensorInfo>,
    /// Where the data section starts in the file (8 + the header's length).
    pub data_start: u64,
}

fn bad(file: &str, why: impl Into<String>) -> SafetensorsError {
    SafetensorsError::Format {
        file: file.into(),
        why: why.into(),
    }
}

/// Parses header JSON for a data section of `data_len` bytes: every tensor's dtype known, its
/// shape's byte count equal to its offsets' span, its span inside the data section and
/// overlapping no other tensor's. `file` names the file in errors.
pub fn parse_header(
    file: &str,
    json: &[u8],
    data_len: u64,
) -> Result<Vec<TensorInfo>, SafetensorsError> {
    let v: Value =
        serde_json::from_slice(json).map_err(|e| bad(file, format!("header JSON: {e}")))?;
    let Value::Object(map) = v else {
        return Err(bad(file, "the header is not a JSON object"));
    };
    let mut out = Vec::with_capacity(map.len());
    for (name, t) in map {
        if name == "__metadata__" {
            continue;
        }
        let dtype_name = t["dtype"]
            .as_str()
            .ok_or_else(|| bad(file, format!("{name}: no dtype")))?;
        let dtype = Dtype::parse(dtype_name)
            .ok_or_else(|| bad(file, format!("{name}: unknown dtype {dtype_name:?}")))?;
        let shape = t["shape"]
            .as_array()
            .ok_or_else(|| bad(file, format!("{name}: no shape")))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad(file, format!("{name}: a dimension is not a count")))
            })
            .collect::<Result<Vec<u64>, _>>()?;
        let offs = t["data_offsets"]
            .as_array()
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad(file, format!("{name}: no data_offsets pair")))?;
        let (Some(begin), Some(end)) = (offs[0].as_u64(), offs[1].as_u64()) else {
            return Err(bad(file, format!("{name}: data_offsets are not counts")));
        };
        if begin > end || end > data_len {
            return Err(bad(
                file,
                format!("{name}: data_offsets {begin}..{end} outside the {data_len} data bytes"),
            ));
        }
        let want = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(file, format!("{name}: shape {shape:?} overflows")))?;
        if want != end - begin {
            return Err(bad(
                file,
                format!(
                    "{name}: {dtype_name} {shape:?} is {want} bytes, its offsets span {}",
                    end - begin
                ),
            ));
        }
        out.push(TensorInfo {
            name,
            dtype,
            shape,
            begin,
            end,
        });
    }
    out.sort_by_key(|t| (t.begin, t.end));
    for w in out.windows(2) {
        if w[1].begin < w[0].end {
            return Err(bad(
                file,
                format!("tensors {} and {} overlap", w[0].name, w[1].name),
            ));
        }
    }
    Ok(out)
}

/// Bytes of a file read at once to find its header (one command; a longer header takes a
/// second read).
const FIRST_HEADER_READ: u64 = 64 << 10;

/// Reads and parses the header of blockfs file `f` (named `name` in errors).
pub fn read_header(name: &str, f: &File) -> Result<Header, SafetensorsError> {
    let len = f.stat()?.size;
    // The length word and (usually all of) the header in one read: every read here is a
    // command, and a load waits for the headers before its GPU reads start.
    let mut head = vec![0u8; len.min(FIRST_HEADER_READ) as usize];
    if len < 8 || f.read_at(0, &mut head)? != head.len() {
        return Err(bad(name, format!("{len} bytes: shorter than a header")));
    }
    let hlen = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    if hlen > len - 8 || hlen > MAX_HEADER_BYTES {
        return Err(bad(
            name,
            format!("a header of {hlen} bytes in a {len}-byte file"),
        ));
    }
    let have = (head.len() - 8).min(hlen as usize);
    let mut json = head[8..8 + have].to_vec();
    if have < hlen as usize {
        json.resize(hlen as usize, 0);
        if f.read_at(8 + have as u64, &mut json[have..])? != hlen as usize - have {
            return Err(bad(name, "short header read"));
        }
    }
    let data_start = 8 + hlen;
    let tensors = parse_header(name, &json, len - data_start)?;
    Ok(Header {
        tensors,
        data_start,
    })
}

/// Where the data section of a file written by [`file_header`] starts: a multiple of this
/// (the header is padded with spaces, as the format allows), so tensors that follow whole
/// blocks stay block aligned for loaders that read or map the file.
pub const DATA_ALIGN: u64 = 4096;

/// One tensor to write ([`file_header`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorToWrite {
    /// Its name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its bytes (must equal the shape's element count times the dtype's size).
    pub bytes: u64,
}

/// The first bytes of a `.safetensors` file holding `tensors` in the order given, their data
/// following each other without gaps: the 8-byte header length, the header JSON (with
/// `metadata` as `__metadata__` when not empty) padded with spaces so the data section starts
/// at a multiple of [`DATA_ALIGN`]. Refuses (as [`SafetensorsError::Format`], naming `file`)
/// a tensor named `__metadata__`, a name given twice, and bytes that do not match a shape.
pub fn file_header(
    file: &str,
    tensors: &[TensorToWrite],
    metadata: &std::collections::BTreeMap<String, String>,
) -> Result<Vec<u8>, SafetensorsError> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut at = 0u64;
    for t in tensors {
        if t.name == "__metadata__" {
            return Err(bad(file, "a tensor may not be named __metadata__"));
        }
        let want = t
            .shape
            .iter()
            .try_fold(t.dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(file, format!("{}: shape {:?} overflows", t.name, t.shape)))?;
        if want != t.bytes {
            return Err(bad(
                file,
                format!(
                    "{}: {} {:?} is {want} bytes, the tensor has {}",
                    t.name,
                    t.dtype.name(),
                    t.shape,
                    t.bytes
                ),
            ));
        }
        let end = at
            .checked_add(t.bytes)
            .ok_or_else(|| bad(file, "tensors larger than the address space"))?;
        let entry = serde_json::json!({
            "dtype": t.dtype.name(),
            "shape": t.shape,
            "data_offsets": [at, end],
        });
        if map.insert(t.name.clone(), entry).is_some() {
            return Err(bad(file, format!("{}: the name is given twice", t.name)));
        }
        at = end;
    }
    let mut json = serde_json::to_vec(&Value::Object(map)).map_err(|e| bad(file, e.to_string()))?;
    let data_start = (8 + json.len() as u64).next_multiple_of(DATA_ALIGN);
    json.resize((data_start - 8) as usize, b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok(out)
}

/// One tensor in the arena.
#[derive(Clone, Debug)]
pub struct Placed {
    /// Which of the loaded files holds it (index into the `files` of [`load`]).
    pub file: usize,
    /// The tensor.
    pub info: TensorInfo,
    /// Its first byte in the arena.
    pub offset: u64,
}

/// The arena's layout for `headers`: each tensor at an [`ARENA_ALIGN`]ed offset, in file and
/// data order; (placements, arena bytes). Refuses a name held by two files.
pub fn layout(names: &[&str], headers: &[Header]) -> Result<(Vec<Placed>, u64), SafetensorsError> {
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut placed = Vec::new();
    let mut at = 0u64;
    for (i, h) in headers.iter().enumerate() {
        for t in &h.tensors {
            if let Some(&first) = seen.get(t.name.as_str()) {
                return Err(SafetensorsError::Duplicate {
                    name: t.name.clone(),
                    first: names[first].to_owned(),
                    second: names[i].to_owned(),
                });
            }
            seen.insert(t.name.as_str(), i);
            placed.push(Placed {
                file: i,
                info: t.clone(),
                offset: at,
            });
            at = at
                .checked_add(t.bytes().next_multiple_of(ARENA_ALIGN))
                .ok_or_else(|| bad(names[i], "tensors larger than the address space"))?;
        }
    }
    Ok((placed, at))
}

/// One read of a load: `len` bytes of file `file`'s data section from `begin` into the arena at
/// `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaRead {
    /// Which file (index into the loaded files).
    pub file: usize,
    /// First byte in the file's data section.
    pub begin: u64,
    /// First byte in the arena.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The reads that fill the arena of `placed` ([`layout`]'s order): tensors that follow each
/// other in a file and in the arena at the same distance are one read (a file whose tensors
/// all start at [`ARENA_ALIGN`]ed offsets is read whole, as one range: no per-tensor heads and
/// tails through slot buffers, no LBA read twice); empty tensors read nothing.
pub fn arena_reads(placed: &[Placed]) -> Vec<ArenaRead> {
    let mut reads: Vec<ArenaRead> = Vec::new();
    for p in placed.iter().filter(|p| p.info.bytes() > 0) {
        if let Some(last) = reads.last_mut()
            && last.file == p.file
            && p.info.begin >= last.begin + last.len
            && p.offset >= last.offset + last.len
            && p.info.begin - last.begin == p.offset - last.offset
        {
            last.len = p.info.end - last.begin;
            continue;
        }
        reads.push(ArenaRead {
            file: p.file,
            begin: p.info.begin,
            offset: p.offset,
            len: p.info.bytes(),
        });
    }
    reads
}

/// Tensors loaded into one GPU allocation.
pub struct Loaded {
    /// The arena (GPU memory, kept alive by whoever holds this: the controller reached it, or
    /// the reads were staged into it where the controller reaches only host memory).
    pub arena: Arc<GpuTarget>,
    /// Every tensor and its place in the arena.
    pub tensors: Vec<Placed>,
    /// Data bytes read.
    pub bytes: u64,
    /// Seconds the batch took on the GPU.
    pub secs: f64,
    /// Seconds spent allocating (and making reachable) the arena.
    pub arena_secs: f64,
    /// Seconds spent putting the files' extent tables in GPU memory and planning the reads.
    pub tables_secs: f64,
    /// Of `tables_secs`, seconds spent opening the files for the GPU (their extent tables into
    /// GPU memory) and passing the controller the read-ahead hint.
    pub open_secs: f64,
    /// When the batch of reads was launched.
    pub launched: std::time::Instant,
}

/// Reads every tensor of `files` (blockfs files with their parsed headers, named `names`)
/// into one new GPU arena on `setup`'s queues, by one batch of GPU file reads; `watch` is the
/// batch's watchdog ([`crate::gpu::watchdog`]).
pub fn load(
    setup: &GpuSetup,
    names: &[&str],
    files: &[(&File, &Header)],
    watch: impl FnMut() -> Option<String> + Send,
) -> Result<Loaded, SafetensorsError> {
    load_with(setup, names, files, watch, |_, _| ()).map(|(loaded, ())| loaded)
}

/// [`load`], running `while_reading` on this thread once the reads are under way: given the
/// arena and the tensors' places, it may build what the caller hands out (a Python caller's
/// tensor views) while the GPU fills the arena, so that work costs no time of its own. It must
/// not read the arena's bytes (they are not there yet). Its result comes back with the load's;
/// when the load fails it is dropped, and the arena with it once nothing else holds it (the
/// call has waited for the reads by then, or given them up to the watchdog).
pub fn load_with<R>(
    setup: &GpuSetup,
    names: &[&str],
    files: &[(&File, &Header)],
    watch: impl FnMut() -> Option<String> + Send,
    while_reading: impl FnOnce(&Arc<GpuTarget>, &[Placed]) -> R,
) -> Result<(Loaded, R), SafetensorsError> {
    load_into_with(setup, names, files, Ahead::default(), watch, while_reading)
}

/// What a fresh process made for a load while its GPU queues were being set up
/// ([`crate::DeviceHandle::load_safetensors`]), each used where it fits.
#[derive(Default)]
pub struct Ahead {
    /// GPU memory for the arena ([`arena_len`] bytes at least).
    pub arena: Option<DeviceMemory>,
    /// A bounce buffer the controller reaches, for staged reads (at least
    /// [`crate::staged::bounce_bytes`] of the tensor bytes).
    pub bounce: Option<gpu_queues::GpuBuffer>,
}

/// The bytes of GPU memory a load of `total` tensor bytes ([`layout`]'s) puts its arena in.
pub fn arena_len(total: u64) -> Result<usize, SafetensorsError> {
    usize::try_from(total.max(ARENA_ALIGN)).map_err(|e| SafetensorsError::Gpu(e.to_string()))
}

/// [`load_with`] with what was made `ahead`: into `ahead.arena` where given, GPU memory of at
/// least [`arena_len`] bytes on `setup`'s GPU, allocated earlier (a fresh process allocates
/// it while its GPU queues are being set up, [`crate::DeviceHandle::load_safetensors`]),
/// uninitialised is fine (the reads write every byte that is handed out). Memory too small or on another GPU is not used (a
/// new arena is allocated); so is any where the transport cannot map memory allocated
/// elsewhere. Where the controller reaches only host memory (a served controller:
/// [`GpuQueues::buffers_in_host_memory`]), the arena is plain GPU memory and the reads
/// are staged through a bounce buffer of the controller's ([`crate::staged`]): `ahead.bounce`
/// where it is large enough.
pub fn load_into_with<R>(
    setup: &GpuSetup,
    names: &[&str],
    files: &[(&File, &Header)],
    ahead: Ahead,
    watch: impl FnMut() -> Option<String> + Send,
    while_reading: impl FnOnce(&Arc<GpuTarget>, &[Placed]) -> R,
) -> Result<(Loaded, R), SafetensorsError> {
    let Ahead {
        arena: pre,
        bounce: pre_bounce,
    } = ahead;
    let headers: Vec<Header> = files.iter().map(|(_, h)| (*h).clone()).collect();
    let (tensors, total) = layout(names, &headers)?;
    let gpu = |e: &dyn std::fmt::Display| SafetensorsError::Gpu(e.to_string());
    let t0 = std::time::Instant::now();
    let gfiles = GpuFiles::new(
        &setup.queues,
        GpuFilesOptions::from_env()
            .map_err(|e| SafetensorsError::InvalidArgument(e.to_string()))?,
    );
    let opened = files
        .iter()
        .map(|(f, _)| gfiles.open(f))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| gpu(&e))?;
    // The controller may prepare for these reads from now on (the software controller has
    // the kernel read a cold image ahead); the hint holds until the reads are over.
    let _ahead = gfiles.will_read(&opened.iter().collect::<Vec<_>>());
    let t_tables = t0.elapsed().as_secs_f64();
    let staged = setup.queues.buffers_in_host_memory();
    let reads = arena_reads(&tensors);
    let (arena, bounce) = if staged {
        let mem = gpu_arena(&setup.queues, arena_len(total)?, pre).map_err(|e| gpu(&e))?;
        let want = crate::staged::bounce_bytes(reads.iter().map(|r| r.len).sum()) as usize;
        let bounce = match pre_bounce {
            Some(b) if b.len() >= want => b,
            _ => setup.queues.alloc_buffer(want).map_err(|e| gpu(&e))?,
        };
        (GpuTarget::unmapped(mem), Some(bounce))
    } else {
        let buf = arena_buffer(&setup.queues, arena_len(total)?, pre).map_err(|e| gpu(&e))?;
        (GpuTarget::mapped(buf), None)
    };
    let arena = Arc::new(arena);
    let arena_secs = t0.elapsed().as_secs_f64() - t_tables;
    if let Some(bounce) = bounce {
        let staged_reads = staged_reads(&reads, &headers);
        let launched = std::time::Instant::now();
        // The views are built while the GPU reads (as below); the job runs on this thread.
        let made = while_reading(&arena, &tensors);
        let out = crate::staged::read_staged(
            &gfiles,
            &opened,
            &staged_reads,
            arena.memory(),
            &bounce,
            watch,
        )
        .map_err(|e| gpu(&e))?;
        let tables_secs = t0.elapsed().as_secs_f64() - arena_secs - out.elapsed.as_secs_f64();
        return finish(
            Loaded {
                arena,
                tensors,
                bytes: out.bytes,
                secs: out.elapsed.as_secs_f64(),
                arena_secs,
                tables_secs: tables_secs.max(0.0),
                open_secs: t_tables,
                launched,
            },
            &reads,
            made,
        );
    }
    let ranges = reads
        .iter()
        .map(|r| {
            let buf = arena.buffer().ok_or_else(|| {
                blockfs_gpu::FilesError::InvalidArgument("the arena is not mapped".into())
            })?;
            let span = GpuSpan::of(buf, r.offset, r.len)?;
            Ok(FileRange::read(
                &opened[r.file],
                headers[r.file].data_start + r.begin,
                span,
            ))
        })
        .collect::<Result<Vec<_>, blockfs_gpu::FilesError>>()
        .map_err(|e| gpu(&e))?;
    let tables_secs = t0.elapsed().as_secs_f64() - arena_secs;
    let launched = std::time::Instant::now();
    let (bytes, secs, made) = if ranges.is_empty() {
        (0, 0.0, while_reading(&arena, &tensors))
    } else {
        let pending = gfiles.submit(&ranges).map_err(|e| gpu(&e))?;
        let made = while_reading(&arena, &tensors);
        let r = pending
            .wait_watched(watch)
            .and_then(|r| r.into_first_error())
            .map_err(|e| gpu(&e))?;
        (r.bytes(), r.elapsed.as_secs_f64(), made)
    };
    finish(
        Loaded {
            arena,
            tensors,
            bytes,
            secs,
            arena_secs,
            tables_secs,
            open_secs: t_tables,
            launched,
        },
        &reads,
        made,
    )
}

/// Loads every tensor of `files` (blockfs files with their parsed headers, named `names`) on
/// a controller a daemon owns into one new arena of GPU memory on `cuda`'s GPU, by Read
/// commands this process's CPU issues on lent queue pairs into a lent bounce and copies into
/// the arena ([`crate::cpu_staged::read_served`]): no GPU queues are set up. The arena is
/// allocated on a thread of its own beside the first reads; `while_reading` runs on this
/// thread once it exists, while the reads go on (as in [`load_with`]). Also the set-up's
/// phases and the seconds the arena's allocation took.
pub fn load_served<R>(
    served: &crate::served::ServedController,
    nsid: u32,
    cuda: &Arc<gpu_queues::Cuda>,
    names: &[&str],
    files: &[(&File, &Header)],
    while_reading: impl FnOnce(&Arc<GpuTarget>, &[Placed]) -> R,
) -> Result<(Loaded, R, crate::cpu_staged::ServedPhases), crate::Error> {
    use crate::cpu_staged;
    let headers: Vec<Header> = files.iter().map(|(_, h)| (*h).clone()).collect();
    let (tensors, total) = layout(names, &headers)?;
    let len = arena_len(total)?;
    let reads = arena_reads(&tensors);
    let staged_reads = staged_reads(&reads, &headers);
    let t0 = std::time::Instant::now();
    let tables = files
        .iter()
        .map(|(f, _)| f.extent_table())
        .collect::<Result<Vec<_>, _>>()?;
    let tables_ref: Vec<&blockfs::table::ExtentTable> = tables.iter().map(|t| t.table()).collect();
    let open_secs = t0.elapsed().as_secs_f64();
    std::thread::scope(|scope| {
        let early_arena = {
            let cuda = cuda.clone();
            scope.spawn(move || {
                let t = std::time::Instant::now();
                (
                    DeviceMemory::alloc_uninit(&cuda, len),
                    t.elapsed().as_secs_f64(),
                )
            })
        };
        let (to_reader, dest_rx) = std::sync::mpsc::channel::<Arc<DeviceMemory>>();
        let launched = std::time::Instant::now();
        let (tables_ref, staged_reads) = (&tables_ref, &staged_reads);
        let reader = scope.spawn(move || {
            let dest = move || {
                dest_rx.recv_timeout(cpu_staged::STALL).map_err(|_| {
                    crate::Error::new(crate::ErrorKind::Device, "the arena was not allocated")
                })
            };
            cpu_staged::read_served(served, nsid, cuda, tables_ref, staged_reads, dest)
        });
        let (mem, arena_secs) = early_arena.join().map_err(|_| {
            crate::Error::new(crate::ErrorKind::Other, "allocating the arena panicked")
        })?;
        let mem = match mem {
            Ok(m) => Arc::new(m),
            Err(e) => {
                drop(to_reader);
                let _ = reader.join();
                return Err(crate::Error::from(SafetensorsError::Gpu(e.to_string())));
            }
        };
        let _ = to_reader.send(mem.clone());
        let arena = Arc::new(GpuTarget::unmapped(mem));
        let made = while_reading(&arena, &tensors);
        let (out, mut phases) = reader.join().map_err(|_| {
            crate::Error::new(crate::ErrorKind::Other, "the staged reader panicked")
        })??;
        phases.arena = arena_secs;
        let loaded = Loaded {
            arena,
            tensors,
            bytes: out.bytes,
            secs: out.elapsed.as_secs_f64(),
            arena_secs,
            tables_secs: open_secs,
            open_secs,
            launched,
        };
        let (loaded, made) = finish(loaded, &reads, made)?;
        Ok((loaded, made, phases))
    })
}

/// The arena's reads as reads of the files (each file's data section starts after its
/// header), for staged loads.
fn staged_reads(reads: &[ArenaRead], headers: &[Header]) -> Vec<StagedRead> {
    reads
        .iter()
        .map(|r| StagedRead {
            file: r.file,
            offset: headers[r.file].data_start + r.begin,
            len: r.len,
            dest: r.offset,
        })
        .collect()
}

/// `loaded`, once it read every byte `reads` asked for.
fn finish<R>(
    loaded: Loaded,
    reads: &[ArenaRead],
    made: R,
) -> Result<(Loaded, R), SafetensorsError> {
    let want: u64 = reads.iter().map(|r| r.len).sum();
    if loaded.bytes != want {
        return Err(SafetensorsError::Gpu(format!(
            "the GPU read {} of {want} tensor bytes",
            loaded.bytes
        )));
    }
    Ok((loaded, made))
}

/// `len` bytes of GPU memory on the queues' GPU for an arena: `pre` where it fits, else new
/// (not zeroed: see [`arena_buffer`]).
fn gpu_arena(
    queues: &GpuQueues,
    len: usize,
    pre: Option<DeviceMemory>,
) -> Result<Arc<DeviceMemory>, GpuError> {
    let fits = |m: &DeviceMemory| m.len() >= len && m.cuda().ordinal() == queues.cuda().ordinal();
    Ok(match pre {
        Some(m) if fits(&m) => Arc::new(m),
        _ => Arc::new(DeviceMemory::alloc_uninit(queues.cuda(), len)?),
    })
}

/// GPU memory for a load's arena, reachable by the controller: not zeroed (the reads write
/// every tensor byte before any tensor is handed out, and a load that reads fewer fails and
/// drops the arena: zeroing would be work thrown away; the allocation itself is most of the
/// arena's time, 1.3-1.8 ms for 1.2 GB and 16-19 ms for 13.5 GB on the lent H200 either way),
/// where the transport maps memory allocated elsewhere; else (a transport that cannot) its own
/// zeroed buffer.
fn arena_buffer(
    queues: &GpuQueues,
    len: usize,
    pre: Option<DeviceMemory>,
) -> Result<gpu_queues::GpuBuffer, GpuError> {
    match queues.map_memory(gpu_arena(queues, len, pre)?) {
        Err(GpuError::Unsupported(_)) => queues.alloc_buffer(len),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(entries: &[(&str, &str, &[u64], u64, u64)]) -> Vec<u8> {
        let mut m = serde_json::Map::new();
        m.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        for (name, dtype, shape, b, e) in entries {
            m.insert(
                (*name).into(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [b, e]}),
            );
        }
        serde_json::to_vec(&Value::Object(m)).unwrap()
    }

    #[test]
    fn a_valid_header_parses_in_data_order() {
        let h = header(&[
            ("b", "BF16", &[3, 5], 24, 54),
            ("a", "F32", &[2, 3], 0, 24),
            ("s", "I64", &[], 54, 62),
            ("e", "F16", &[0, 4], 62, 62),
        ]);
        let t = parse_header("m", &h, 62).unwrap();
        let names: Vec<&str> = t.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "s", "e"]);
        assert_eq!(t[1].dtype, Dtype::BF16);
        assert_eq!(t[1].shape, [3, 5]);
        assert_eq!(t[2].bytes(), 8);
    }

    #[test]
    fn bad_headers_are_refused_with_the_reason() {
        let cases: Vec<(Vec<u8>, u64, &str)> = vec![
            (b"not json".to_vec(), 10, "header JSON"),
            (b"[1,2]".to_vec(), 10, "not a JSON object"),
            (header(&[("a", "F33", &[1], 0, 4)]), 4, "unknown dtype"),
            (header(&[("a", "F32", &[2], 0, 4)]), 4, "is 8 bytes"),
            (header(&[("a", "F32", &[1], 0, 4)]), 3, "outside"),
            (header(&[("a", "F32", &[1], 4, 0)]), 8, "outside"),
            (
                header(&[("a", "F32", &[1], 0, 4), ("b", "F32", &[1], 2, 6)]),
                8,
                "overlap",
            ),
            (header(&[("a", "U8", &[u64::MAX, 2], 0, 4)]), 8, "overflows"),
        ];
        for (json, len, why) in cases {
            let e = parse_header("m.safetensors", &json, len).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(why), "{msg:?} should say {why:?}");
            assert!(msg.contains("m.safetensors"), "{msg:?} names the file");
        }
    }

    /// A U8 tensor at `b..e` of the data section.
    fn t(name: &str, b: u64, e: u64) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![e - b],
            begin: b,
            end: e,
        }
    }

    #[test]
    fn layout_aligns_every_tensor_and_refuses_duplicates() {
        let h1 = Header {
            tensors: vec![t("a", 0, 3), t("b", 3, 300)],
            data_start: 64,
        };
        let h2 = Header {
            tensors: vec![t("c", 0, 0), t("d", 0, 1)],
            data_start: 72,
        };
        let (placed, total) = layout(&["x", "y"], &[h1.clone(), h2]).unwrap();
        let offs: Vec<u64> = placed.iter().map(|p| p.offset).collect();
        assert_eq!(offs, [0, 256, 768, 768]);
        assert_eq!(total, 1024);
        assert!(placed.iter().all(|p| p.offset % ARENA_ALIGN == 0));
        let e = layout(&["x", "y"], &[h1.clone(), h1]).unwrap_err();
        assert!(matches!(e, SafetensorsError::Duplicate { ref name, .. } if name == "a"));
    }

    #[test]
    fn aligned_files_are_read_whole_and_others_per_tensor() {
        // x: every tensor starts 256-aligned (one read of the whole data section, the last
        // tensor's odd length included); y: "f" starts at 3, so "f" and "g" read apart;
        // empty tensors read nothing.
        let hx = Header {
            tensors: vec![
                t("a", 0, 512),
                t("e0", 512, 512),
                t("b", 512, 1024),
                t("c", 1024, 1100),
            ],
            data_start: 64,
        };
        let hy = Header {
            tensors: vec![t("d", 0, 3), t("f", 3, 300), t("g", 300, 301)],
            data_start: 80,
        };
        let (placed, _) = layout(&["x", "y"], &[hx, hy]).unwrap();
        let reads = arena_reads(&placed);
        let r = |file, begin, offset, len| ArenaRead {
            file,
            begin,
            offset,
            len,
        };
        assert_eq!(
            reads,
            [
                r(0, 0, 0, 1100),
                r(1, 0, 1280, 3),
                r(1, 3, 1536, 297),
                r(1, 300, 2048, 1)
            ]
        );
        // Every tensor's bytes lie inside exactly one read, at its arena offset.
        for p in placed.iter().filter(|p| p.info.bytes() > 0) {
            let n = reads
                .iter()
                .filter(|q| {
                    q.file == p.file
                        && q.begin <= p.info.begin
                        && p.info.end <= q.begin + q.len
                        && q.offset + (p.info.begin - q.begin) == p.offset
                })
                .count();
            assert_eq!(n, 1, "{}", p.info.name);
        }
    }

    #[test]
    fn written_headers_parse_back_and_align_the_data() {
        let tensors = vec![
            TensorToWrite {
                name: "w".into(),
                dtype: Dtype::BF16,
                shape: vec![3, 5],
                bytes: 30,
            },
            TensorToWrite {
                name: "b".into(),
                dtype: Dtype::F32,
                shape: vec![],
                bytes: 4,
            },
            TensorToWrite {
                name: "e".into(),
                dtype: Dtype::I8,
                shape: vec![0, 7],
                bytes: 0,
            },
        ];
        let meta = [("format".to_string(), "pt".to_string())]
            .into_iter()
            .collect();
        let head = file_header("m", &tensors, &meta).unwrap();
        assert_eq!(head.len() as u64 % DATA_ALIGN, 0);
        let hlen = u64::from_le_bytes(head[..8].try_into().unwrap());
        assert_eq!(hlen + 8, head.len() as u64);
        let parsed = parse_header("m", &head[8..], 34).unwrap();
        let got: Vec<(&str, u64, u64)> = parsed
            .iter()
            .map(|t| (t.name.as_str(), t.begin, t.end))
            .collect();
        assert_eq!(got, [("w", 0, 30), ("b", 30, 34), ("e", 34, 34)]);
        let v: Value = serde_json::from_slice(&head[8..]).unwrap();
        assert_eq!(v["__metadata__"]["format"], "pt");

        let mut wrong = tensors.clone();
        wrong[0].bytes = 31;
        let e = file_header("m", &wrong, &meta).unwrap_err().to_string();
        assert!(e.contains("is 30 bytes, the tensor has 31"), "{e}");
        let mut twice = tensors.clone();
        twice[1].name = "w".into();
        let e = file_header("m", &twice, &meta).unwrap_err().to_string();
        assert!(e.contains("given twice"), "{e}");
        let mut reserved = tensors;
        reserved[2].name = "__metadata__".into();
        assert!(file_header("m", &reserved, &meta).is_err());
    }

    #[test]
    fn dtype_names_round_trip() {
        for (d, name, size) in Dtype::ALL {
            assert_eq!(Dtype::parse(name), Some(d));
            assert_eq!(d.name(), name);
            assert_eq!(d.size(), size);
        }
        assert_eq!(Dtype::parse("bf16"), None);
    }

    #[test]
    fn headers_shorter_and_longer_than_the_first_read_parse() {
        use blockfs::{FileSystem, MemDevice, MkfsOptions, OpenMode};
        let dev = Arc::new(MemDevice::new(512, 16 << 11));
        let fs = FileSystem::mkfs(dev, &MkfsOptions::default()).unwrap();
        // 4 tensors (a few hundred bytes of header), and 3,000 (past the first 64 KiB read).
        for (i, n) in [4usize, 3000].into_iter().enumerate() {
            let tensors: Vec<TensorToWrite> = (0..n)
                .map(|k| TensorToWrite {
                    name: format!("layer.{k}.weight"),
                    dtype: Dtype::F32,
                    shape: vec![2],
                    bytes: 8,
                })
                .collect();
            let head = file_header("m", &tensors, &Default::default()).unwrap();
            assert_eq!(
                head.len() as u64 > FIRST_HEADER_READ,
                i == 1,
                "{} bytes",
                head.len()
            );
            let name = format!("m{i}.safetensors");
            let f = fs.create(&name, &Default::default()).unwrap();
            let mut bytes = head.clone();
            bytes.extend((0..n * 8).map(|b| b as u8));
            f.write_at(0, &bytes).unwrap();
            drop(f);
            let h = read_header(&name, &fs.open(&name, OpenMode::ReadOnly).unwrap()).unwrap();
            assert_eq!(h.data_start, head.len() as u64);
            assert_eq!(h.tensors.len(), n);
            assert_eq!(h.tensors[n - 1].name, format!("layer.{}.weight", n - 1));
            assert_eq!(
                (h.tensors[n - 1].begin, h.tensors[n - 1].end),
                (8 * n as u64 - 8, 8 * n as u64)
            );
        }
    }
}
