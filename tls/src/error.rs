//! The crate's one error type: every problem with the TLS flags, the certificate files or
//! certificate generation, as one sentence that names the flag or the file.

use std::path::PathBuf;

/// What went wrong, in words a person can act on.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A combination of flags that cannot work (e.g. `--tls-cert` without `--tls-key`).
    #[error("{0}")]
    Flags(String),
    /// A file named by a flag could not be read.
    #[error("cannot read {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file was read but holds no usable PEM of the expected kind.
    #[error("{} is not a valid {what}: {message}", path.display())]
    Pem {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
    /// rustls refused the material (e.g. a key that does not match the certificate).
    #[error("{context}: {source}")]
    Rustls {
        context: String,
        source: rustls::Error,
    },
    /// A client-certificate verifier or server verifier could not be built from a CA file.
    #[error("{} cannot verify certificates: {message}", path.display())]
    Verifier { path: PathBuf, message: String },
    /// Certificate generation failed.
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
    /// A file that `pdctl certs` would write exists (and `--force` was not given).
    #[error("{} exists; pass --force to overwrite it", .0.display())]
    Exists(PathBuf),
    /// Writing a generated file failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}
