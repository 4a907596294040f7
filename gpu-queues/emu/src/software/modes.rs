//! How the copy engines move data, as the environment chooses: [`CopyMode`]
//! (`GPUNVME_EMU_DMA`), [`StagedCopies`] (`GPUNVME_EMU_STAGED`) and whether every read is
//! ordered after the engine's writes (`GPUNVME_EMU_FETCH`).

use gpu_queues::GpuError;

use crate::env_choice;

/// Reads of at least this many bytes go by copy engine when [`StagedCopies::Engine`]; smaller
/// ones (a call each would cost more than the copy) go by the scatter kernel.
pub const ENGINE_COPY_MIN: usize = 64 << 10;

/// How a Read's data staged from the image reaches GPU memory: `GPUNVME_EMU_STAGED`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagedCopies {
    /// By copy engines, one copy per run of adjacent Reads of [`ENGINE_COPY_MIN`] bytes or
    /// more (the default): the controller's SMs are left to the completions and small pieces.
    Engine,
    /// By the scatter kernel on the controller's SMs, like every other staged write.
    Kernel,
}

impl StagedCopies {
    /// `GPUNVME_EMU_STAGED=engine|kernel` (unset: engine, or kernel in [`CopyMode::Memcpy`],
    /// where pieces are copies already).
    pub(super) fn from_env() -> Result<Self, GpuError> {
        Self::choose(gpunvme_settings::EMU_STAGED.value().as_deref())
    }

    const VAR: &str = gpunvme_settings::EMU_STAGED.name;

    pub(super) fn choose(var: Option<&str>) -> Result<Self, GpuError> {
        let c = [("engine", Self::Engine), ("kernel", Self::Kernel)];
        Ok(env_choice::choice(Self::VAR, var, &c)?.unwrap_or(Self::Engine))
    }
}

/// How an engine moves a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMode {
    /// One scatter or gather kernel per batch (the default).
    Kernels,
    /// One `cuMemcpyAsync` per piece, no kernels: for `compute-sanitizer`, which runs one
    /// kernel at a time, so the controller's kernels would wait behind the client kernel that
    /// waits for them. About 0.3 M commands/s (../shared/design/gpu.md): for checking only.
    /// Chosen under compute-sanitizer, or with `GPUNVME_EMU_DMA=memcpy`.
    Memcpy,
}

impl CopyMode {
    /// The mode `GPUNVME_EMU_DMA` asks for (`kernels` or `memcpy`); unset, `memcpy` under
    /// compute-sanitizer ([`gpu_queues::queues::under_compute_sanitizer`], logged) and
    /// `kernels` otherwise.
    pub fn from_env() -> Result<Self, GpuError> {
        Self::choose(
            gpunvme_settings::EMU_DMA.value().as_deref(),
            gpu_queues::queues::under_compute_sanitizer(),
        )
    }

    /// [`CopyMode::from_env`] from the variable's value and whether the sanitizer runs.
    pub(super) fn choose(var: Option<&str>, sanitizer: bool) -> Result<Self, GpuError> {
        let c = [("kernels", Self::Kernels), ("memcpy", Self::Memcpy)];
        Ok(
            match env_choice::choice(gpunvme_settings::EMU_DMA.name, var, &c)? {
                Some(mode) => mode,
                None if sanitizer => {
                    tracing::info!(
                        "compute-sanitizer detected: the software controller copies with \
                     cuMemcpyAsync (GPUNVME_EMU_DMA=kernels overrides)"
                    );
                    Self::Memcpy
                }
                None => Self::Kernels,
            },
        )
    }
}

/// `GPUNVME_EMU_FETCH=ordered|unordered` (default `unordered`): whether reads of GPU memory the
/// controller never wrote still wait for its earlier writes (the behaviour before such reads
/// got a stream of their own; for comparisons).
pub(super) fn fetch_always_ordered() -> Result<bool, GpuError> {
    fetch_ordered_from(gpunvme_settings::EMU_FETCH.value().as_deref())
}

pub(super) fn fetch_ordered_from(var: Option<&str>) -> Result<bool, GpuError> {
    let c = [("ordered", true), ("unordered", false)];
    Ok(env_choice::choice(gpunvme_settings::EMU_FETCH.name, var, &c)?.unwrap_or(false))
}
