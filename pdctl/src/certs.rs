//! `pdctl certs`: a cluster CA and one member certificate for every part of the cluster
//! (serverAuth + clientAuth), for clusters without cert-manager and for local mTLS.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;

#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory to write `ca.crt`, `ca.key`, `node.crt` and `node.key` to (created if
    /// missing; keys get mode 0600).
    #[arg(long)]
    out: PathBuf,
    /// The names and addresses the parts are dialed by, comma separated (DNS names or IPs,
    /// e.g. `pd-prefill,pd-decode,pd-router,10.0.0.7`); `localhost` and `127.0.0.1` are
    /// always added.
    #[arg(long, value_delimiter = ',')]
    hosts: Vec<String>,
    /// Overwrite existing files.
    #[arg(long)]
    force: bool,
}

pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    let written = pd_tls::certs::write_cluster_certs(&args.out, &args.hosts, args.force)
        .context("pdctl certs")?;
    for path in &written {
        println!("{}", path.display());
    }
    let dir = args.out.display();
    eprintln!(
        "every part: --tls-cert {dir}/node.crt --tls-key {dir}/node.key --tls-ca {dir}/ca.crt; \
         nodes also --tls-client-ca {dir}/ca.crt; clients: --ca {dir}/ca.crt. \
         Keep ca.key offline: it signs cluster members."
    );
    Ok(())
}
