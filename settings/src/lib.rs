//! The environment variables gpunvme's libraries read, declared once: [`ALL`] lists each with
//! its type, default and what it does (`docs/settings.md` is made from it and checked against
//! it by this crate's tests), and [`Setting::value`] is the one place library code reads the
//! environment (a test fails on any other read in a library's sources).
//!
//! The variables are for comparisons, test suites and bring-up; an application sets the same
//! things through the options structs, whose `Default` never reads the environment. A value
//! that is set but cannot be used is an error at the call that reads it (each crate words it
//! as its own error: a GPU queue option, an emulator setting), never ignored.
#![forbid(unsafe_code)]

use std::fmt;

/// One environment variable a library reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// Its name.
    pub name: &'static str,
    /// What values it takes (`mapped | pread`, `1 to 3600`, ...).
    pub values: &'static str,
    /// What applies when it is unset or empty.
    pub default: &'static str,
    /// The crate that reads it.
    pub read_by: &'static str,
    /// What it does.
    pub doc: &'static str,
}

impl Setting {
    /// The variable's value, trimmed: `None` when unset or empty. A value that is not UTF-8 is
    /// returned with its bad bytes replaced (U+FFFD), so that the caller's parser refuses it
    /// rather than treating it as unset.
    pub fn value(&self) -> Option<String> {
        let v = std::env::var_os(self.name)?;
        let v = v.to_string_lossy().trim().to_owned();
        (!v.is_empty()).then_some(v)
    }

    /// The error for a `value` of this variable that cannot be used.
    pub fn invalid(&self, value: &str) -> SettingError {
        SettingError {
            name: self.name,
            value: value.to_owned(),
            expected: self.values,
        }
    }

    /// `value` as a number in `min..=max` (`None`: unset), else [`SettingError`].
    pub fn number_in(
        &self,
        value: Option<&str>,
        min: u64,
        max: u64,
    ) -> Result<Option<u64>, SettingError> {
        match value {
            None => Ok(None),
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
                _ => Err(self.invalid(v)),
            },
        }
    }

    /// The variable read as a number in `min..=max` (`None`: unset).
    pub fn read_number_in(&self, min: u64, max: u64) -> Result<Option<u64>, SettingError> {
        self.number_in(self.value().as_deref(), min, max)
    }
}

/// A variable set to a value that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingError {
    /// The variable.
    pub name: &'static str,
    /// What it holds.
    pub value: String,
    /// What it takes.
    pub expected: &'static str,
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={:?}: expected {} (unset it for the default; docs/settings.md)",
            self.name, self.value, self.expected
        )
    }
}

impl std::error::Error for SettingError {}

macro_rules! settings {
    ($($(#[$m:meta])* $id:ident = $name:literal, $values:literal, $default:literal, $by:literal, $doc:literal;)*) => {
        $(
            $(#[$m])*
            #[doc = concat!("`", $name, "` (", $values, "; default ", $default, "): ", $doc)]
            pub const $id: Setting = Setting {
                name: $name,
                values: $values,
                default: $default,
                read_by: $by,
                doc: $doc,
            };
        )*
        /// Every variable, in the order of `docs/settings.md`.
        pub const ALL: &[Setting] = &[$($id),*];
    };
}

settings! {
    EMU_CONTROLLER_THREADS = "NVME_EMU_CONTROLLER_THREADS", "1 to 64", "a quarter of the CPUs, 1 to 4", "nvme_emu",
        "Threads of the software controller where its configuration asks for the automatic count (`controller_threads` 0), e.g. to run a whole test suite with several.";
    EMU_IMAGE_READS = "NVME_EMU_IMAGE_READS", "`mapped` or `pread`", "mapped where the image is in memory (tmpfs), else pread", "nvme_emu",
        "How the software controller reads image blocks for CPU queues where its configuration leaves it automatic.";
    GPU_TIMEOUT_S = "GPUNVME_GPU_TIMEOUT_S", "whole seconds, 1 to 3600", "10 (120 under compute-sanitizer; 30 on a real SSD)", "gpu_queues",
        "Bound of every wait on GPU queues whose options leave the timeout unset: tools that slow kernels many times need more.";
    GPU_TRANSPORT = "GPUNVME_GPU_TRANSPORT", "`vfio-p2p` or `host-memory`", "every real-SSD transport, in order", "gpu_queues",
        "Restricts a real SSD's GPU queues to one transport, e.g. to bring the host-memory rings up before P2P.";
    HOST_GPU_SMS = "GPUNVME_HOST_GPU_SMS", "a positive number", "16", "gpu_queues (host-gpu builds)",
        "SMs the host-gpu harness (the CUDA sources on CPU threads) reports for each of its stand-in GPUs.";
    HOST_GPU_COUNT = "GPUNVME_HOST_GPU_COUNT", "1 to 16", "1", "gpu_queues (host-gpu builds)",
        "Stand-in GPUs the host-gpu harness presents (ordinals 0 to N-1, each with its own frees held back and launch gate), so that code for several GPUs runs without one.";
    HOST_GPU_THREADS = "GPUNVME_HOST_GPU_THREADS", "1 to 4294967294", "4096", "gpu_queues (host-gpu builds; the C++ harness)",
        "Most emulated GPU threads resident at once in the host-gpu harness (blocks beyond run when earlier ones end).";
    HOST_GPU_WAIT_S = "GPUNVME_HOST_GPU_WAIT_S", "whole seconds, 1 to 4294967294", "120", "gpu_queues (host-gpu builds; the C++ harness)",
        "Bound of the host-gpu harness's own waits (a launch, a synchronize) before it reports a hang.";
    HOST_GPU_SLEEP_NS = "GPUNVME_HOST_GPU_SLEEP_NS", "nanoseconds, 1 to 4294967294", "20000", "gpu_queues (host-gpu builds; the C++ harness)",
        "The shortest sleep of a polling emulated GPU thread in the host-gpu harness (more threads alive sleep longer).";
    EMU_READS = "GPUNVME_EMU_READS", "`mapped`, `pread` or `registered`", "mapped where guarded copies work (x86-64 Linux), else pread", "gpu_emu",
        "How Read data for GPU queues leaves the software controller's image: copied out of a mapping, read by pread, or copied by a copy engine from registered windows.";
    EMU_COLD_READS = "GPUNVME_EMU_COLD_READS", "`direct`, `buffered` or `prefetch`", "buffered", "gpu_emu",
        "How Reads of image data not in the page cache are read: O_DIRECT into staging memory, through the page cache, or read ahead in file order into a bounded pool.";
    EMU_PIN_BUDGET = "GPUNVME_EMU_PIN_BUDGET", "bytes (a whole number)", "half the machine's memory", "gpu_emu",
        "The most image bytes registered with CUDA at once for `GPUNVME_EMU_READS=registered`.";
    EMU_PREFETCH_READERS = "GPUNVME_EMU_PREFETCH_READERS", "1 to 64", "4", "gpu_emu",
        "Reader threads of a prefetch (`GPUNVME_EMU_COLD_READS=prefetch`).";
    EMU_READAHEAD = "GPUNVME_EMU_READAHEAD", "`on`, `off` or a thread count from 1 to 16", "on (4 threads), off where cold reads are direct", "gpu_emu",
        "Whether a hint of reads to come has the kernel read uncached parts of the image ahead of the controller threads.";
    EMU_RINGS = "GPUNVME_EMU_RINGS", "`gpu` or `host`", "the options' `host_rings`, else gpu", "gpu_emu",
        "Where the software controller's GPU rings live: GPU memory (bulk transfers) or host memory (lowest latency per command).";
    EMU_STAGED = "GPUNVME_EMU_STAGED", "`engine` or `kernel`", "engine (kernel where DMA is memcpy)", "gpu_emu",
        "Who moves staged data between host staging memory and GPU buffers for the software controller: copy engines or its own kernels.";
    EMU_DMA = "GPUNVME_EMU_DMA", "`kernels` or `memcpy`", "kernels (memcpy under compute-sanitizer)", "gpu_emu",
        "How the software controller moves a batch: one scatter or gather kernel, or one cuMemcpyAsync per piece (for compute-sanitizer, which runs one kernel at a time).";
    EMU_FETCH = "GPUNVME_EMU_FETCH", "`ordered` or `unordered`", "unordered", "gpu_emu",
        "Whether the software controller's reads of GPU memory it never wrote still wait for its earlier writes (the older behaviour, for comparisons).";
    FILE_CHUNKS = "GPUNVME_FILE_CHUNKS", "`claim` or `spread`", "claim", "blockfs_gpu",
        "How GPU file reads' warps take chunks: claiming their next ones as they finish, or an even share each, for comparisons.";
    FILE_CLAIM_WARPS = "GPUNVME_FILE_CLAIM_WARPS", "1 to 8", "2", "blockfs_gpu",
        "Warps per queue when chunks are claimed.";
    FILE_CLAIM_LEAST = "GPUNVME_FILE_CLAIM_LEAST", "1 to 32", "8", "blockfs_gpu",
        "The fewest chunks one claim takes in a batch's last round (32 keeps claims whole).";
    SERVED_READS = "GPUNVME_SERVED_READS", "`auto`, `cpu` or `gpu`", "auto: the CPU for jobs under 2 GiB, else the GPU", "gpunvme",
        "Who issues a served device's loads and `read_into` reads: this process's CPU on lent queue pairs (quick to set up, no GPU kernels to time-slice between processes), or GPU threads on served GPU queues (faster reads).";
    SERVED_WINDOWS = "GPUNVME_SERVED_WINDOWS", "COUNTxMIB: 2 to 64 windows of 1 to 256 MiB", "4x4", "gpunvme",
        "How a served device's CPU-issued reads cut their lent bounce buffer (each window registered with CUDA on its own).";
    SERVED_PAIRS = "GPUNVME_SERVED_PAIRS", "1 to 64 queue pairs", "the controller's threads, at most half this host's CPUs", "gpunvme",
        "Queue pairs a served device's CPU-issued reads take (each served by one thread of a software controller; a daemon's threads beyond the host's cores slow each other down).";
}

/// Whether this process runs under NVIDIA's compute-sanitizer, told by the injection
/// environment the sanitizer gives the programs it launches (`NV_SANITIZER_INJECTION_*`, or an
/// `*_INJECTION64_PATH` naming its library). Not a setting: the sanitizer's own variables,
/// read so that waits get a longer default bound under it.
pub fn under_compute_sanitizer() -> bool {
    sanitizer_in(|k| std::env::var(k).ok())
}

/// [`under_compute_sanitizer`] over any environment.
pub fn sanitizer_in(get: impl Fn(&str) -> Option<String>) -> bool {
    get("NV_SANITIZER_INJECTION_PORT_BASE").is_some()
        || get("NV_SANITIZER_INJECTION_TRANSPORT_TYPE").is_some()
        || ["CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH"]
            .iter()
            .any(|k| get(k).is_some_and(|v| v.contains("sanitizer")))
}

/// `docs/settings.md`: the table of [`ALL`].
pub fn markdown() -> String {
    let mut s = String::from(
        "# Settings: the environment variables\n\n\
         Every environment variable gpunvme's libraries read, made from the table in\n\
         `settings/src/lib.rs` (`gpunvme_settings::ALL`; a test checks this file against it).\n\
         They are for comparisons, test suites and bring-up: applications set the same things\n\
         through the options structs, whose defaults never read the environment. Unset or empty\n\
         means the default; a value that cannot be used is an error naming the variable, never\n\
         ignored. The CLI and the test scripts may read variables of their own (their `--help`\n\
         and `docs/testing.md` say which).\n\n\
         | Variable | Values | Default | Read by | What it does |\n|---|---|---|---|---|\n",
    );
    for v in ALL {
        s.push_str(&format!(
            "| `{}` | {} | {} | {} | {} |\n",
            v.name, v.values, v.default, v.read_by, v.doc
        ));
    }
    s.push_str(
        "\nRead but not settings: compute-sanitizer's own variables (`NV_SANITIZER_INJECTION_*`,\n\
         `CUDA_INJECTION64_PATH`, `NVTX_INJECTION64_PATH`), to give waits a longer bound under it;\n\
         `CUDA_MODULE_LOADING`, which gpunvme sets to `EAGER` before CUDA starts unless it is set.\n",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_documented() {
        for (i, a) in ALL.iter().enumerate() {
            assert!(
                a.name.starts_with("GPUNVME_") || a.name.starts_with("NVME_EMU_"),
                "{}",
                a.name
            );
            assert!(!a.doc.is_empty() && !a.values.is_empty() && !a.default.is_empty());
            assert!(
                ALL[i + 1..].iter().all(|b| b.name != a.name),
                "{} twice",
                a.name
            );
        }
    }

    #[test]
    fn numbers_in_range_or_an_error_that_names_the_variable() {
        let s = GPU_TIMEOUT_S;
        assert_eq!(s.number_in(None, 1, 3600), Ok(None));
        assert_eq!(s.number_in(Some(" 30 "), 1, 3600), Ok(Some(30)));
        let e = s.number_in(Some("0"), 1, 3600).unwrap_err();
        assert_eq!(
            e.to_string(),
            "GPUNVME_GPU_TIMEOUT_S=\"0\": expected whole seconds, 1 to 3600 (unset it for the default; docs/settings.md)"
        );
        assert!(s.number_in(Some("ten"), 1, 3600).is_err());
    }

    #[test]
    fn the_sanitizer_is_told_by_its_injection_environment() {
        assert!(!sanitizer_in(|_| None));
        assert!(sanitizer_in(
            |k| (k == "NV_SANITIZER_INJECTION_PORT_BASE").then(|| "1".into())
        ));
        assert!(sanitizer_in(
            |k| (k == "CUDA_INJECTION64_PATH").then(|| "/x/libsanitizer-collection.so".into())
        ));
        assert!(!sanitizer_in(
            |k| (k == "CUDA_INJECTION64_PATH").then(|| "/x/libnsys.so".into())
        ));
    }
}
