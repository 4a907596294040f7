//! The library's one error type, [`Error`]: what failed, in words a caller of any surface
//! (Rust, Python, C, the CLI) can show as is, and its [`ErrorKind`], a field set where the error
//! is made — from the typed error of the crate underneath ([`From`] impls below) or by the call
//! that refuses — so callers that answer per kind (the CLI's `--json` error objects, Python's
//! exception classes, C's error codes) read it rather than guess it.

use std::fmt;

/// The kinds of failure a caller may want to tell apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Another process (or handle) owns the device or image.
    Busy,
    /// No such file.
    NotFound,
    /// The file exists.
    Exists,
    /// The file system is full, or the host file system holding an image is.
    NoSpace,
    /// The file is open read-only, or the handle or file system is (a change refused up
    /// front on a handle opened read-only).
    ReadOnly,
    /// The namespace holds no blockfs.
    NoFileSystem,
    /// On-disk data failed its checks (metadata checksum, data checksum, format).
    Corrupt,
    /// A caller's argument is not acceptable (a name, a size, an offset, a host path's kind).
    InvalidArgument,
    /// A host file or stream failed.
    Io,
    /// The image file cannot be opened, created or used.
    Image,
    /// The device (controller, VFIO, a command) failed.
    Device,
    /// Refused before anything changed: the call would destroy data.
    Refused,
    /// Another file-system error.
    FileSystem,
    /// Anything else.
    Other,
}

impl ErrorKind {
    /// The kind's name in JSON error objects: `busy`, `not_found`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Busy => "busy",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Exists => "exists",
            ErrorKind::NoSpace => "no_space",
            ErrorKind::ReadOnly => "read_only",
            ErrorKind::NoFileSystem => "no_file_system",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Io => "io",
            ErrorKind::Image => "image",
            ErrorKind::Device => "device",
            ErrorKind::Refused => "refused",
            ErrorKind::FileSystem => "file_system",
            ErrorKind::Other => "error",
        }
    }
}

/// A call refused before anything changed, because it would destroy data
/// ([`ErrorKind::Refused`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// A caller's argument that cannot work (a combination of options, a value out of range):
/// [`ErrorKind::InvalidArgument`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidArgument(pub String);

/// An error from the library: its [`kind`](Error::kind), what was being done (the contexts,
/// outermost first) and its cause (the typed error underneath, or a message).
///
/// `Display` writes the whole chain on one line, `context: context: cause: cause's source`, the
/// way `anyhow`'s `{:#}` does, so [`std::error::Error::source`] is `None` (a chain printer
/// would otherwise print the causes twice); the typed cause is reached with
/// [`Error::cause_ref`].
pub struct Error {
    kind: ErrorKind,
    context: Vec<String>,
    cause: Box<dyn std::error::Error + Send + Sync + 'static>,
}

/// The library's `Result`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A cause that is only words.
#[derive(Debug)]
struct Message(String);

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Message {}

impl Error {
    /// An error of `kind` saying `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self::with_cause(kind, Message(message.into()))
    }

    /// An error of `kind` caused by `cause` (its kind decided here, not by `cause`).
    pub fn with_cause(
        kind: ErrorKind,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            context: Vec::new(),
            cause: Box::new(cause),
        }
    }

    /// An [`ErrorKind::InvalidArgument`] error saying `message`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The same error, said to be of `kind`.
    pub fn with_kind(mut self, kind: ErrorKind) -> Self {
        self.kind = kind;
        self
    }

    /// The same error inside `context` (what was being done: "getting a.bin").
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.context.insert(0, context.to_string());
        self
    }

    /// The first error of type `T` in the cause's chain (the cause, its source, ...).
    pub fn cause_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(&*self.cause);
        while let Some(e) = next {
            if let Some(t) = e.downcast_ref::<T>() {
                return Some(t);
            }
            next = e.source();
        }
        None
    }

    /// The cause itself, if it is a `T` (for setting a surface's hint, e.g.
    /// [`crate::open::MissingImage::hint`]).
    pub fn cause_mut<T: std::error::Error + 'static>(&mut self) -> Option<&mut T> {
        self.cause.downcast_mut::<T>()
    }

    /// Whether the cause's chain holds a `T`.
    pub fn is<T: std::error::Error + 'static>(&self) -> bool {
        self.cause_ref::<T>().is_some()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.context {
            write!(f, "{c}: ")?;
        }
        write!(f, "{}", self.cause)?;
        let mut next = self.cause.source();
        while let Some(e) = next {
            write!(f, ": {e}")?;
            next = e.source();
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Error {{ kind: {:?}, message: {:?} }}",
            self.kind,
            self.to_string()
        )
    }
}

impl std::error::Error for Error {}

/// `.context(...)` and `.with_context(|| ...)` on results whose error becomes an [`Error`].
pub trait Context<T> {
    /// The error inside `context`.
    fn context(self, context: impl fmt::Display) -> Result<T>;
    /// The error inside `context()`, evaluated only on error.
    fn with_context<C: fmt::Display>(self, context: impl FnOnce() -> C) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, context: impl fmt::Display) -> Result<T> {
        self.map_err(|e| e.into().context(context))
    }

    fn with_context<C: fmt::Display>(self, context: impl FnOnce() -> C) -> Result<T> {
        self.map_err(|e| e.into().context(context()))
    }
}

impl<T> Context<T> for Option<T> {
    /// `None` becomes an [`ErrorKind::Other`] error saying `context`.
    fn context(self, context: impl fmt::Display) -> Result<T> {
        self.ok_or_else(|| Error::new(ErrorKind::Other, context.to_string()))
    }

    fn with_context<C: fmt::Display>(self, context: impl FnOnce() -> C) -> Result<T> {
        self.ok_or_else(|| Error::new(ErrorKind::Other, context().to_string()))
    }
}

/// Returns an [`Error`] of the given kind with a formatted message:
/// `bail!(InvalidArgument, "...", args)`.
macro_rules! bail {
    ($kind:ident, $($arg:tt)*) => {
        return Err($crate::error::Error::new($crate::error::ErrorKind::$kind, format!($($arg)*)))
    };
}
pub(crate) use bail;

/// Returns an [`Error`] of the given kind unless `cond`: `ensure!(cond, Device, "...", args)`.
macro_rules! ensure {
    ($cond:expr, $kind:ident, $($arg:tt)*) => {
        if !$cond {
            $crate::error::bail!($kind, $($arg)*);
        }
    };
}
pub(crate) use ensure;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kind_is_set_where_the_error_is_made_and_contexts_keep_it() {
        let e = Error::from(blockfs::Error::NotFound("a".into())).context("getting a");
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(e.to_string(), "getting a: no such file: a");
        assert!(e.is::<blockfs::Error>());
        let e: Result<()> = Err(std::io::Error::other("x")).context("reading");
        let e = e.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        assert_eq!(e.to_string(), "reading: x");
        let plain = Error::new(ErrorKind::Other, "plain");
        assert_eq!(plain.kind(), ErrorKind::Other);
        assert_eq!(plain.with_kind(ErrorKind::Busy).kind(), ErrorKind::Busy);
        assert_eq!(ErrorKind::NoSpace.as_str(), "no_space");
        // A transparent wrapper of a blockfs error says the blockfs error's kind.
        let e = Error::from(crate::copy::CopyError::Fs(blockfs::Error::AlreadyExists(
            "b".into(),
        )));
        assert_eq!(e.kind(), ErrorKind::Exists);
    }

    #[test]
    fn a_chain_from_a_binary_finds_the_library_error_first() {
        // What the CLI does with an anyhow chain: the first library error's own kind decides,
        // even over a typed cause that would say another.
        let inner = Error::new(ErrorKind::Refused, "would destroy it");
        let chain: [&(dyn std::error::Error + 'static); 2] =
            [&inner, &blockfs::Error::NotFound("x".into())];
        assert_eq!(ErrorKind::of_chain(chain), ErrorKind::Refused);
        let io = std::io::Error::other("y");
        assert_eq!(
            ErrorKind::of_chain([&io as &(dyn std::error::Error + 'static)]),
            ErrorKind::Io
        );
        assert_eq!(ErrorKind::of_chain([]), ErrorKind::Other);
    }

    #[test]
    fn a_refused_host_write_is_named_for_its_cause() {
        let failed = |no_space| {
            Error::from(crate::open::HostWriteFailed {
                path: "disk.img".into(),
                no_space,
                host: "No space left on device (os error 28)".into(),
                device: "Write Fault".into(),
            })
        };
        let e = failed(true);
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert!(
            e.to_string()
                .starts_with("no space left on the host file system holding disk.img (ENOSPC"),
            "{e}"
        );
        assert_eq!(failed(false).kind(), ErrorKind::Io);
        let missing = Error::from(crate::open::MissingImage {
            path: "x.img".into(),
            default: false,
            hint: None,
        })
        .context("opening x.img");
        assert_eq!(missing.kind(), ErrorKind::NotFound);
        let worded = crate::open::MissingImage::explain(missing, |_| "make it so".into());
        assert_eq!(
            worded.to_string(),
            "opening x.img: image x.img does not exist (make it so)"
        );
    }
}
