//! A copy out of a file mapping that survives the page that cannot be read.
//!
//! Reading a page of a shared file mapping that the kernel cannot bring in (a disk error on a
//! page that was evicted, a file truncated under the mapping) raises SIGBUS in the reading
//! thread, which by default kills the process. [`copy`] turns that into an error for the one
//! copy that met it, the way the kernel's own `copy_to_user` uses exception tables:
//!
//! - the copy is one `rep movsb` at a known address (`gpunvme_guarded_copy_insn`, in the
//!   assembly below): the CPU's fast string copy, the same instruction glibc's `memcpy` and the
//!   kernel's `pread` use for copies of this size;
//! - a SIGBUS handler, installed once (process-wide, the first time a copy is asked for),
//!   looks at the faulting instruction: if it is that `rep movsb` and the fault was raised by the
//!   kernel, it moves the saved instruction pointer past the instruction and returns, so the
//!   copy ends early with `rcx` (the bytes left) nonzero and [`copy`] reports how far it got.
//!   The registers of a `rep movsb` are architecturally exact at a fault;
//! - any other SIGBUS goes where it would have gone without us: the previous handler is called
//!   (Python's `faulthandler`, say), or, where there was none, the default action is restored
//!   and the faulting instruction runs again under it (the process dies with the same signal
//!   and core it would have).
//!
//! A handler installed after ours (and not chaining to it) takes SIGBUS away from us; a fault
//! in a copy then goes to that handler, as it would have with a plain `memcpy`. Only SIGBUS is
//! handled: a copy from an address that is not mapped at all (SIGSEGV) is a bug and crashes.
//!
//! x86-64 Linux only ([`available`]); elsewhere callers read with `pread`.
// UNSAFETY: a signal handler that edits the interrupted thread's saved registers, and a copy
// between raw addresses in assembly; both are the FFI boundary to the kernel's signal delivery.
#![expect(unsafe_code)]

/// Whether guarded copies work on this target.
pub const fn available() -> bool {
    cfg!(all(target_arch = "x86_64", target_os = "linux"))
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Once, OnceLock};

    // gpunvme_guarded_copy(dst: rdi, src: rsi, n: rdx) -> bytes not copied (rax).
    // `rep movsb` is 2 bytes (F3 A4): the handler resumes at the label + 2 with `rcx` as the
    // fault left it. The direction flag is clear on entry (System V ABI). Hidden: each shared
    // object that embeds this crate has its own copy, never interposed by another's.
    std::arch::global_asm!(
        ".pushsection .text.gpunvme_guarded_copy,\"ax\",@progbits",
        ".globl gpunvme_guarded_copy",
        ".hidden gpunvme_guarded_copy",
        ".type gpunvme_guarded_copy,@function",
        "gpunvme_guarded_copy:",
        "    mov rcx, rdx",
        ".globl gpunvme_guarded_copy_insn",
        ".hidden gpunvme_guarded_copy_insn",
        "gpunvme_guarded_copy_insn:",
        "    rep movsb",
        "    mov rax, rcx",
        "    ret",
        ".size gpunvme_guarded_copy, .-gpunvme_guarded_copy",
        ".popsection",
    );

    unsafe extern "C" {
        fn gpunvme_guarded_copy(dst: *mut u8, src: *const u8, n: usize) -> usize;
        static gpunvme_guarded_copy_insn: u8;
    }

    /// Length of `rep movsb` in bytes.
    const INSN_LEN: usize = 2;

    /// The disposition SIGBUS had before ours: set once, before our handler is installed, and
    /// only read afterwards (by the handler: `OnceLock::get` is one atomic load).
    static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
    /// Whether our handler is installed.
    static INSTALLED: AtomicBool = AtomicBool::new(false);
    static INSTALL: Once = Once::new();

    /// Where `rep movsb` sits.
    fn insn() -> usize {
        // Only the address of the symbol is taken (never read as data): no unsafe needed.
        (&raw const gpunvme_guarded_copy_insn) as usize
    }

    extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo and ucontext to an SA_SIGINFO handler, for
        // this thread, and this handler runs on the thread that faulted; the saved registers
        // it edits are restored by sigreturn when it returns. Only async-signal-safe work here:
        // reads and writes of that context, sigaction(2) and raise(3).
        unsafe {
            let uc = ctx.cast::<libc::ucontext_t>();
            let rip = libc::REG_RIP as usize;
            // si_code > 0: raised by the kernel for a fault, not sent by kill(2) or a queue.
            let fault = !info.is_null() && (*info).si_code > 0;
            if fault && !uc.is_null() {
                let gregs = &mut (*uc).uc_mcontext.gregs;
                if gregs[rip] as usize == insn() {
                    gregs[rip] = (insn() + INSN_LEN) as i64;
                    return;
                }
            }
            // Not a fault of ours: where SIGBUS would have gone.
            let prev = PREVIOUS.get();
            match prev.map(|p| p.sa_sigaction) {
                Some(h) if h != libc::SIG_DFL && h != libc::SIG_IGN => {
                    if prev.is_some_and(|p| p.sa_flags & libc::SA_SIGINFO != 0) {
                        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                            std::mem::transmute(h);
                        f(sig, info, ctx);
                    } else {
                        let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
                        f(sig);
                    }
                }
                Some(libc::SIG_IGN) if !fault => {} // a sent SIGBUS that was ignored before
                _ => {
                    // The default action (a fault's SIGBUS cannot be ignored): a fault's
                    // instruction runs again and the kernel delivers the signal under it; a
                    // sent signal is sent again (blocked in this handler, it is delivered,
                    // under the default action, once the handler returns).
                    let mut dfl: libc::sigaction = std::mem::zeroed();
                    dfl.sa_sigaction = libc::SIG_DFL;
                    libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
                    if !fault {
                        libc::raise(sig);
                    }
                }
            }
        }
    }

    /// Installs the handler once; false if the kernel refused it.
    fn install() -> bool {
        INSTALL.call_once(|| {
            // SAFETY: sigaction(2) with valid structures. PREVIOUS is set before the handler
            // that reads it is installed.
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_sigbus as *const () as usize;
                act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut act.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) != 0 {
                    return;
                }
                let _ = PREVIOUS.set(old);
                let ok = libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut()) == 0;
                INSTALLED.store(ok, Ordering::Release);
            }
        });
        INSTALLED.load(Ordering::Acquire)
    }

    /// See [`super::copy`].
    ///
    /// # Safety
    /// As [`super::copy`].
    pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) -> Result<(), usize> {
        if n == 0 {
            return Ok(());
        }
        if !install() {
            return Err(0);
        }
        // SAFETY: the caller's contract: `dst..dst + n` writable and `src..src + n` mapped.
        let left = unsafe { gpunvme_guarded_copy(dst, src, n) };
        if left == 0 {
            Ok(())
        } else {
            Err(n - left.min(n))
        }
    }
}

/// Copies `n` bytes from `src` (in a shared file mapping) to `dst`. A page of the source that
/// cannot be read (SIGBUS) ends the copy: `Err(copied)` says how many bytes made it (the rest
/// of `dst` is untouched). `Err(0)` also when the SIGBUS handler could not be installed.
///
/// # Safety
/// `dst..dst + n` is writable memory that no Rust reference aliases (pinned staging memory, in
/// this crate), `src..src + n` lies in a live mapping of this process, and the ranges do not
/// overlap. Bytes of the source that another thread or the kernel changes during the copy are
/// copied as found (a raw copy, not a Rust read of shared data).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) -> Result<(), usize> {
    // SAFETY: forwarded contract.
    unsafe { imp::copy(dst, src, n) }
}

/// Without guarded copies ([`available`] is false): always `Err(0)`, nothing copied.
///
/// # Safety
/// None needed; the signature matches the guarded version.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
pub(crate) unsafe fn copy(_dst: *mut u8, _src: *const u8, _n: usize) -> Result<(), usize> {
    Err(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    /// A file of `pages` 4 KiB pages, page i filled with byte i+1, mapped shared read-only.
    fn mapped(name: &str, pages: usize) -> (std::fs::File, gpu_queues::ffi::os::Mapping) {
        let mut f = crate::os::scratch_file(&format!("guarded-{name}"));
        for i in 0..pages {
            f.write_all(&[i as u8 + 1; 4096]).unwrap();
        }
        let m = gpu_queues::ffi::os::Mapping::read_only(f.as_fd(), pages * 4096).unwrap();
        (f, m)
    }

    #[test]
    fn copies_a_mapped_range() {
        if !available() {
            eprintln!("skipped: guarded copies need x86-64 Linux");
            return;
        }
        let (_f, m) = mapped("copies", 4);
        let mut out = vec![0u8; 2 * 4096 + 1000];
        // SAFETY: `out` is ours and unaliased during the call; the source lies in `m`.
        let r = unsafe { copy(out.as_mut_ptr(), m.ptr().add(4096 + 100), out.len()) };
        assert_eq!(r, Ok(()));
        assert!(out[..4096 - 100].iter().all(|&b| b == 2));
        assert!(out[4096 - 100..2 * 4096 - 100].iter().all(|&b| b == 3));
        assert!(out[2 * 4096 - 100..].iter().all(|&b| b == 4));
        assert_eq!(out.len() - (2 * 4096 - 100), 1100);
    }

    #[test]
    fn a_page_lost_under_the_mapping_is_an_error_not_a_crash() {
        if !available() {
            eprintln!("skipped: guarded copies need x86-64 Linux");
            return;
        }
        let (f, m) = mapped("lost", 4);
        // Truncated to 2 pages: reading the third page of the mapping raises SIGBUS.
        f.set_len(2 * 4096).unwrap();
        let mut out = vec![0xEEu8; 3 * 4096];
        // SAFETY: as above.
        let r = unsafe { copy(out.as_mut_ptr(), m.ptr().add(1000), out.len()) };
        assert_eq!(r, Err(2 * 4096 - 1000), "the copy stops at the lost page");
        assert!(out[..4096 - 1000].iter().all(|&b| b == 1));
        assert!(out[4096 - 1000..2 * 4096 - 1000].iter().all(|&b| b == 2));
        assert!(
            out[2 * 4096 - 1000..].iter().all(|&b| b == 0xEE),
            "the rest untouched"
        );
        // The handler stays: a second fault is caught too, and a good range still copies.
        // SAFETY: as above.
        let r = unsafe { copy(out.as_mut_ptr(), m.ptr().add(3 * 4096), 16) };
        assert_eq!(r, Err(0));
        // SAFETY: as above.
        let r = unsafe { copy(out.as_mut_ptr(), m.ptr(), 4096) };
        assert_eq!(r, Ok(()));
        assert!(out[..4096].iter().all(|&b| b == 1));
    }
}
