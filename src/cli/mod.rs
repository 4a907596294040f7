//! Printing and argument handling of each `gpunvme` command; the work itself lives in the
//! library crates.
//!
//! Output conventions (docs/cli.md, "Output and exit status"): everything a command reports goes to
//! standard output through [`outln!`], whose write errors become [`StdoutError`]s: a closed
//! pipe ends the command quietly (exit 0), any other write error is a one-line error. Errors
//! are one line on standard error, and with `--json` also a JSON object on standard output
//! ([`json_error`]). Names from the device are printed through [`escape`].

/// `println!` to standard output that returns write errors (as [`StdoutError`]) instead of
/// panicking: use it in functions returning `anyhow::Result`.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        writeln!(::std::io::stdout().lock(), $($arg)*).map_err($crate::cli::StdoutError)?
    }};
}

pub mod discover;
pub mod fs;
pub mod identify;
pub mod image;
pub mod io;
pub mod log;
pub mod perf;
pub mod protocol;
pub mod serve;
pub mod topology;

/// Writing to standard output failed (a closed pipe, a full disk).
#[derive(Debug, thiserror::Error)]
#[error("writing to standard output")]
pub struct StdoutError(#[source] pub std::io::Error);

impl StdoutError {
    /// Whether the reader went away (EPIPE): a normal end, not an error.
    pub fn is_broken_pipe(&self) -> bool {
        self.0.kind() == std::io::ErrorKind::BrokenPipe
    }
}

/// The [`StdoutError`] in `e`'s chain, directly or inside an `std::io::Error` (as a writer
/// passed through I/O code reports it).
pub fn stdout_error(e: &anyhow::Error) -> Option<&StdoutError> {
    e.chain().find_map(|c| {
        c.downcast_ref::<StdoutError>().or_else(|| {
            c.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<StdoutError>())
        })
    })
}

/// A command refused to do something that would destroy data (or that cannot work), before
/// changing anything.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

pub use gpunvme::units::escape_control as escape;

/// A short name for what kind of error `e` is, for scripts (`{"error": {"kind": ...}}`).
pub fn error_kind(e: &anyhow::Error) -> &'static str {
    if stdout_error(e).is_some() {
        return "stdout";
    }
    if e.chain().any(|c| c.is::<Refusal>()) {
        return "refused";
    }
    gpunvme::ErrorKind::of_chain(e.chain()).as_str()
}

/// `e`, named for its cause when a software controller among `backends` saw the host refuse a
/// write to its image ([`gpunvme::open::HostWriteFailed`], e.g. its file system full).
pub fn explain_host_error<'a>(
    e: anyhow::Error,
    backends: impl IntoIterator<Item = &'a gpunvme::open::Backend>,
) -> anyhow::Error {
    let at_device = e.chain().any(|c| {
        c.is::<nvme::Error>()
            || c.downcast_ref::<gpunvme::Error>()
                .is_some_and(|g| g.is::<nvme::Error>())
    });
    match gpunvme::open::host_write_failure(backends, at_device, || format!("{e:#}")) {
        Some(h) => gpunvme::Error::from(h).into(),
        None => e,
    }
}

/// The JSON form of an error: `{"error": {"kind": ..., "message": ...}}`.
pub fn json_error(kind: &str, message: &str) -> serde_json::Value {
    serde_json::json!({ "error": { "kind": kind, "message": message } })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping() {
        assert_eq!(escape("models/a.bin"), "models/a.bin");
        assert_eq!(escape("a\nb\tc\u{1b}[31m"), "a\\nb\\tc\\u{1b}[31m");
        assert!(matches!(escape("plain"), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn kinds() {
        let busy = anyhow::Error::new(nvme_emu::EmuError::ImageBusy {
            path: "x".into(),
            holder: Some(1),
            wanted_exclusive: true,
        });
        assert_eq!(error_kind(&busy), "busy");
        let nf = anyhow::Error::new(blockfs::Error::NotFound("a".into())).context("getting a");
        assert_eq!(error_kind(&nf), "not_found");
        let copy = anyhow::Error::new(gpunvme::copy::CopyError::Fs(blockfs::Error::NoSpace {
            needed: 2,
            free: 1,
        }));
        assert_eq!(error_kind(&copy), "no_space");
        let r = anyhow::Error::new(Refusal("no".into()));
        assert_eq!(error_kind(&r), "refused");
        assert_eq!(error_kind(&anyhow::anyhow!("plain")), "error");
        let pipe = || std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        let wrapped = anyhow::Error::new(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            StdoutError(pipe()),
        ))
        .context("writing the destination file");
        assert!(stdout_error(&wrapped).is_some_and(StdoutError::is_broken_pipe));
        assert_eq!(error_kind(&wrapped), "stdout");
        let direct = anyhow::Error::new(StdoutError(pipe()));
        assert!(stdout_error(&direct).is_some());
        assert_eq!(
            json_error("busy", "m"),
            serde_json::json!({"error": {"kind": "busy", "message": "m"}})
        );
    }
}
