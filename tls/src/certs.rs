//! Certificates for a cluster (`pdctl certs`, and tests): one CA and member certificates it
//! signs. A member certificate is both a server and a client certificate (serverAuth and
//! clientAuth), since every part of the cluster serves and dials. Keys are ECDSA P-256.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::error::TlsError;

/// How long generated certificates are valid: the CA ten years, members one year.
const CA_YEARS: i32 = 10;
const MEMBER_YEARS: i32 = 1;

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct CertPem {
    pub cert: String,
    pub key: String,
}

/// A cluster CA that can issue member certificates.
pub struct ClusterCa {
    params: CertificateParams,
    key: KeyPair,
    pem: CertPem,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

/// Today's date (UTC) as (year, month, day), from the system clock.
fn today() -> (i32, u8, u8) {
    let days = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Days since 1970-01-01 to a civil date (the proleptic Gregorian calendar).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u8;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
    let year = (yoe + era * 400 + i64::from(month <= 2)) as i32;
    (year, month, day)
}

/// Valid from yesterday (clocks differ a little) for `years` years. Day 28 at most, so that
/// the end date exists in every month.
fn validity(params: &mut CertificateParams, years: i32) {
    let (year, month, day) = today();
    let (from_month, from_day) = if day > 1 {
        (month, (day - 1).min(28))
    } else {
        (month, 1)
    };
    params.not_before = rcgen::date_time_ymd(year, from_month, from_day);
    params.not_after = rcgen::date_time_ymd(year + years, from_month, from_day);
}

impl ClusterCa {
    /// A new CA named `common_name`.
    pub fn new(common_name: &str) -> Result<Self, TlsError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity(&mut params, CA_YEARS);
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        let pem = CertPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        };
        Ok(Self { params, key, pem })
    }

    /// The CA's own certificate and key.
    pub fn pem(&self) -> &CertPem {
        &self.pem
    }

    /// A member certificate for `hosts` (DNS names or IP addresses; `localhost` and
    /// `127.0.0.1` are always added), for serving and dialing (serverAuth + clientAuth).
    pub fn issue_member(&self, hosts: &[String]) -> Result<CertPem, TlsError> {
        let mut names: Vec<String> = Vec::new();
        for host in hosts
            .iter()
            .map(|h| h.trim().to_string())
            .chain(["localhost".to_string(), "127.0.0.1".to_string()])
        {
            if !host.is_empty() && !names.contains(&host) {
                names.push(host);
            }
        }
        let mut params = CertificateParams::new(names.clone())?;
        params
            .distinguished_name
            .push(DnType::CommonName, names[0].clone());
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, MEMBER_YEARS);
        let key = KeyPair::generate()?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer)?;
        Ok(CertPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }
}

/// The files `pdctl certs` writes, in `dir`.
pub const FILES: [&str; 4] = ["ca.crt", "ca.key", "node.crt", "node.key"];

/// A CA and one member certificate for `hosts`, written to `dir` as [`FILES`] (keys with
/// mode 0600). Existing files are refused unless `force`. Returns the paths written.
pub fn write_cluster_certs(
    dir: &Path,
    hosts: &[String],
    force: bool,
) -> Result<Vec<PathBuf>, TlsError> {
    let paths: Vec<PathBuf> = FILES.iter().map(|f| dir.join(f)).collect();
    if !force && let Some(existing) = paths.iter().find(|p| p.exists()) {
        return Err(TlsError::Exists(existing.clone()));
    }
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let ca = ClusterCa::new("pd-cluster CA")?;
    let member = ca.issue_member(hosts)?;
    let contents = [
        (&ca.pem().cert, false),
        (&ca.pem().key, true),
        (&member.cert, false),
        (&member.key, true),
    ];
    for (path, (text, secret)) in paths.iter().zip(contents) {
        write_file(path, text.as_bytes(), secret)?;
    }
    Ok(paths)
}

/// Writes `bytes` to `path`, readable by its owner only when `secret`.
pub fn write_file(path: &Path, bytes: &[u8], secret: bool) -> Result<(), TlsError> {
    use std::io::Write as _;
    let fail = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        options.mode(if secret { 0o600 } else { 0o644 });
        let mut file = options.open(path).map_err(fail)?;
        // An existing file keeps its mode on open: set it (before writing the secret).
        file.set_permissions(std::fs::Permissions::from_mode(if secret {
            0o600
        } else {
            0o644
        }))
        .map_err(fail)?;
        file.write_all(bytes).map_err(fail)?;
        Ok(())
    }
    #[cfg(not(unix))]
    {
        let _ = secret;
        let mut file = options.open(path).map_err(fail)?;
        file.write_all(bytes).map_err(fail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn today_is_a_plausible_date() {
        let (year, month, day) = today();
        assert!(year >= 2024 && (1..=12).contains(&month) && (1..=31).contains(&day));
    }

    #[test]
    fn writes_four_files_keys_private_and_refuses_to_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let written = write_cluster_certs(dir.path(), &["pd-router".into()], false).unwrap();
        assert_eq!(written.len(), 4);
        #[cfg(unix)]
        for (path, mode) in written.iter().zip([0o644, 0o600, 0o644, 0o600]) {
            use std::os::unix::fs::PermissionsExt as _;
            let got = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
            assert_eq!(got, mode, "{}", path.display());
        }
        let err = write_cluster_certs(dir.path(), &[], false).unwrap_err();
        assert!(err.to_string().contains("--force"), "{err}");
        let before = std::fs::read(dir.path().join("ca.crt")).unwrap();
        write_cluster_certs(dir.path(), &[], true).unwrap();
        assert_ne!(before, std::fs::read(dir.path().join("ca.crt")).unwrap());
    }
}
