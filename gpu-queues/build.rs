//! With the `host-gpu` feature, compiles the project's CUDA sources for the host: g++ builds
//! `ptx/host/gpunvme_host.cpp` (the CPU runtime standing in for the GPU, which includes the
//! runtime's `ptx/kernels/gpunvme_kernels.cu`, the tools' `ptx/kernels/gpunvme_tool_kernels.cu`
//! and the emulated controllers' `ptx/emu/gpunvme_emu_kernels.cu` against
//! `ptx/host/gpunvme_host.h`) into the static library `gpunvme_host` that
//! `src/ffi/host_gpu.rs` calls. Without the feature (the default, CUDA build) it does nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_HOST_GPU").is_some() {
        #[cfg(feature = "host-gpu")]
        host_gpu();
    }
}

#[cfg(feature = "host-gpu")]
fn host_gpu() {
    for path in [
        "../ptx/host",
        "../ptx/include",
        "../ptx/kernels/gpunvme_kernels.cu",
        "../ptx/kernels/gpunvme_tool_kernels.cu",
        "../ptx/kernels/gpunvme_cache_kernels.cu",
        "../ptx/emu/gpunvme_controller.cuh",
        "../ptx/emu/gpunvme_emu_kernels.cu",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    cc::Build::new()
        .cpp(true)
        .file("../ptx/host/gpunvme_host.cpp")
        .include("../ptx/include")
        .include("../ptx/emu")
        .define("GPUNVME_HOST_BUILD", "1")
        .flag("-std=c++20")
        .flag("-O2")
        .flag("-pthread")
        .flag("-fno-strict-aliasing")
        .flag("-Wno-unused-parameter")
        // `#pragma unroll` is nvcc's; g++ ignores it.
        .flag("-Wno-unknown-pragmas")
        .compile("gpunvme_host");
    println!("cargo:rustc-link-lib=pthread");
}
