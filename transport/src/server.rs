//! The export side: a small TCP server on the prefill node that serves reads of leased KV
//! blocks (the "remote memory" an importer reads).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pd_engine::serve::{LeaseSecret, LeasedKv};
use pd_tls::{Conn, ServerTls};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufStream};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::chunks::{write_abort, write_block};
use crate::fingerprint::LayoutFingerprint;
use crate::stats::{FailureReason, TransferStats};
use crate::wire::{
    FRAME_HEADER_LEN, FrameHeader, FrameKind, MAX_CHUNK_BYTES, MAX_PULL_BYTES,
    PULL_REQUEST_BODY_LEN, PullRequestFrame, PullResponseFrame, Status, VERSION,
};

/// Where exported KV blocks come from: the registered "memory region" of the RDMA model,
/// addressed by lease and block range.
///
/// Implemented by [`pd_engine::serve::EngineHandle`] (through `lease_blocks`). Calls run on
/// the async runtime, once per batch of a pull: they must not block.
pub trait KvSource: Send + Sync {
    /// Blocks `first .. first + count` of lease `lease_id`, each in the engine's block layout
    /// (`Backend::read_block`), lent without a copy. `None` if the lease does not exist
    /// (released, expired), `secret` is not its secret, or it does not cover the range; an
    /// implementation must not let a caller tell these apart.
    fn read_blocks(
        &self,
        lease_id: u64,
        secret: &LeaseSecret,
        first: usize,
        count: usize,
    ) -> Option<SharedBlocks>;
}

impl KvSource for pd_engine::serve::EngineHandle {
    fn read_blocks(
        &self,
        lease_id: u64,
        secret: &LeaseSecret,
        first: usize,
        count: usize,
    ) -> Option<SharedBlocks> {
        SharedBlocks::new(self.lease_blocks(lease_id, secret)?, first, count)
    }
}

/// The one message of every refusal of an unauthenticated pull: which of the three it was
/// is not said.
pub(crate) const DENIED: &str =
    "no such lease here, or the lease secret or block range does not match it";

/// A run of a lease's blocks with their checksums, lent to the exporter: the lease stays
/// shared (an `Arc`), so serving a pull copies and hashes nothing before the socket.
#[derive(Debug, Clone)]
pub struct SharedBlocks {
    lease: Arc<LeasedKv>,
    first: usize,
    count: usize,
}

impl SharedBlocks {
    /// Blocks `first .. first + count` of `lease`; `None` if the lease is shorter.
    pub fn new(lease: Arc<LeasedKv>, first: usize, count: usize) -> Option<Self> {
        let end = first.checked_add(count)?;
        (end <= lease.num_blocks() && end <= lease.checksums.len()).then_some(Self {
            lease,
            first,
            count,
        })
    }

    /// Blocks in the run.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bytes of each block.
    pub fn block_bytes(&self) -> usize {
        self.lease.block_bytes()
    }

    /// Block `i` of the run, in transfer layout, as one or more pieces in order.
    pub fn block_pieces(&self, i: usize) -> Vec<&[u8]> {
        assert!(i < self.count, "block {i} of a run of {}", self.count);
        self.lease.block_pieces(self.first + i)
    }

    /// `checksums()[i]` belongs to block `i` of the run.
    pub fn checksums(&self) -> &[u64] {
        &self.lease.checksums[self.first..self.first + self.count]
    }
}

/// Tuning of an export server. The defaults suit production.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// Bytes of blocks asked of the source per call (default 32 MiB; at least one block): a
    /// lease released mid-transfer is noticed at the next batch, and the transfer aborted.
    pub batch_bytes: usize,
    /// A connection with no request for this long is closed (default 60 s).
    pub idle_timeout: Duration,
    /// Upper bound of one transfer, whatever deadline the importer sent (default 120 s).
    pub max_transfer_time: Duration,
    /// TLS on this port (default none: plaintext). With a client CA, a connection whose
    /// client presented no certificate the CA signed is closed after the handshake, before
    /// it is read from or written to.
    pub tls: Option<ServerTls>,
}

impl Default for ExportConfig {
    fn default() -> Self {
        Self {
            batch_bytes: 32 << 20,
            idle_timeout: Duration::from_secs(60),
            max_transfer_time: Duration::from_secs(120),
            tls: None,
        }
    }
}

/// Cumulative counters of an export server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportStats {
    /// Connections accepted.
    pub connections: u64,
    /// Pulls whose payload was sent in full.
    pub pulls_ok: u64,
    /// Pulls refused before any payload (unknown lease, fingerprint, length, bad request).
    pub pulls_refused: u64,
    /// Pulls that started and did not finish (aborted, deadline, connection lost).
    pub pulls_failed: u64,
    /// Payload bytes of completed pulls.
    pub bytes_sent: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    pulls_ok: AtomicU64,
    pulls_refused: AtomicU64,
    pulls_failed: AtomicU64,
    bytes_sent: AtomicU64,
}

impl Counters {
    fn bump(c: &AtomicU64, by: u64) {
        c.fetch_add(by, Ordering::Relaxed);
    }
}

struct Ctx {
    fingerprint: LayoutFingerprint,
    source: Arc<dyn KvSource>,
    config: ExportConfig,
    counters: Counters,
    /// For the node's metrics: what this exporter served, and its failures by reason.
    transfers: Arc<TransferStats>,
}

/// A running export server. Dropping it stops it at once (open transfers are cut);
/// [`KvExportServer::shutdown`] stops it gracefully.
pub struct KvExportServer {
    local_addr: SocketAddr,
    ctx: Arc<Ctx>,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for KvExportServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvExportServer")
            .field("local_addr", &self.local_addr)
            .field("fingerprint", &self.ctx.fingerprint)
            .finish_non_exhaustive()
    }
}

impl KvExportServer {
    /// Listen on `addr` (port 0: an ephemeral port) and serve pulls of `source`'s leases to
    /// importers whose layout fingerprint equals `fingerprint`. Must be called within a tokio
    /// runtime; the server runs as tasks on it. Returns the server and the address it listens
    /// on.
    pub async fn bind(
        addr: SocketAddr,
        fingerprint: LayoutFingerprint,
        source: Arc<dyn KvSource>,
    ) -> io::Result<(Self, SocketAddr)> {
        Self::bind_with(addr, fingerprint, source, ExportConfig::default()).await
    }

    /// [`KvExportServer::bind`] with explicit tuning.
    pub async fn bind_with(
        addr: SocketAddr,
        fingerprint: LayoutFingerprint,
        source: Arc<dyn KvSource>,
        config: ExportConfig,
    ) -> io::Result<(Self, SocketAddr)> {
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let ctx = Arc::new(Ctx {
            fingerprint,
            source,
            config,
            counters: Counters::default(),
            transfers: Arc::default(),
        });
        let (shutdown, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&ctx), rx));
        tracing::info!(%local_addr, %fingerprint, "KV export server listening");
        let server = Self {
            local_addr,
            ctx,
            shutdown,
            task: Some(task),
        };
        Ok((server, local_addr))
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn fingerprint(&self) -> LayoutFingerprint {
        self.ctx.fingerprint
    }

    pub fn stats(&self) -> ExportStats {
        let c = &self.ctx.counters;
        ExportStats {
            connections: c.connections.load(Ordering::Relaxed),
            pulls_ok: c.pulls_ok.load(Ordering::Relaxed),
            pulls_refused: c.pulls_refused.load(Ordering::Relaxed),
            pulls_failed: c.pulls_failed.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
        }
    }

    /// The counters of the transfers this server served (completed and failed), for the
    /// node's metrics.
    pub fn transfer_stats(&self) -> Arc<TransferStats> {
        Arc::clone(&self.ctx.transfers)
    }

    /// Stop accepting, close idle connections, let transfers in flight finish for up to
    /// `grace`, then cut whatever is left. The port is free when this returns.
    pub async fn shutdown(mut self, grace: Duration) {
        let _ = self.shutdown.send(true);
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(grace, &mut task).await.is_err()
        {
            task.abort();
            let _ = task.await;
        }
        tracing::info!(local_addr = %self.local_addr, "KV export server stopped");
    }
}

impl Drop for KvExportServer {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Resolves once the server is told to stop (or is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

async fn accept_loop(listener: TcpListener, ctx: Arc<Ctx>, mut shutdown: watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    let for_conns = shutdown.clone();
    loop {
        tokio::select! {
            _ = stopped(&mut shutdown) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    Counters::bump(&ctx.counters.connections, 1);
                    tracing::debug!(%peer, "KV import connection");
                    conns.spawn(serve_conn(stream, Arc::clone(&ctx), for_conns.clone()));
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "KV export server: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

/// Serve requests on one connection until it closes, idles out or the server stops.
async fn serve_conn(stream: TcpStream, ctx: Arc<Ctx>, mut shutdown: watch::Receiver<bool>) {
    let _ = stream.set_nodelay(true);
    let Some(stream) = secure(stream, ctx.config.tls.as_ref()).await else {
        return;
    };
    let mut s = BufStream::with_capacity(64 << 10, 256 << 10, stream);
    loop {
        let mut head = [0u8; FRAME_HEADER_LEN];
        let read = tokio::select! {
            _ = stopped(&mut shutdown) => return,
            r = tokio::time::timeout(ctx.config.idle_timeout, s.read_exact(&mut head)) => r,
        };
        if !matches!(read, Ok(Ok(_))) {
            return; // idle, closed by the peer, or broken
        }
        let header = match FrameHeader::decode(&head) {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!(error = %e, "KV export: not a pd-transport peer");
                return;
            }
        };
        if let Err(e) = header.expect(FrameKind::PullRequest, PULL_REQUEST_BODY_LEN) {
            let status = if header.version != VERSION {
                Status::UnsupportedVersion
            } else {
                Status::BadRequest
            };
            let refusal = PullResponseFrame::refusal(status, e.to_string());
            let _ = send(&mut s, &refusal).await;
            return;
        }
        let mut body = [0u8; PULL_REQUEST_BODY_LEN];
        if !matches!(
            tokio::time::timeout(ctx.config.idle_timeout, s.read_exact(&mut body)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let req = PullRequestFrame::decode_body(&body);
        let limit = match req.timeout_ms {
            0 => ctx.config.max_transfer_time,
            ms => Duration::from_millis(u64::from(ms)).min(ctx.config.max_transfer_time),
        };
        match tokio::time::timeout(limit, serve_pull(&mut s, &req, &ctx)).await {
            Ok(Ok(Next::KeepAlive)) => {}
            Ok(Ok(Next::Close)) => return,
            Ok(Err(e)) => {
                Counters::bump(&ctx.counters.pulls_failed, 1);
                ctx.transfers.record_failure(FailureReason::Connection);
                tracing::debug!(lease = req.lease_id, error = %e, "KV export: transfer failed");
                return;
            }
            Err(_) => {
                Counters::bump(&ctx.counters.pulls_failed, 1);
                ctx.transfers.record_failure(FailureReason::Timeout);
                tracing::debug!(
                    lease = req.lease_id,
                    "KV export: transfer past its deadline"
                );
                return;
            }
        }
    }
}

/// The connection as this port serves it: the TLS handshake when configured (in this
/// connection's task, bounded by the handshake timeout: a silent client holds up no other),
/// and `None` (close it) when it fails or when a required client certificate is missing.
async fn secure(stream: TcpStream, tls: Option<&ServerTls>) -> Option<Conn> {
    let Some(tls) = tls else {
        return Some(Conn::Plain(stream));
    };
    let peer = stream.peer_addr().ok();
    let conn = match tls.accept(stream).await {
        Ok(conn) => conn,
        Err(e) => {
            tracing::debug!(?peer, error = %e, "KV export: TLS handshake failed");
            return None;
        }
    };
    if tls.requires_client_certs() && !conn.peer_info().client_verified {
        tracing::debug!(?peer, "KV export: no cluster client certificate; closing");
        return None;
    }
    Some(conn)
}

enum Next {
    KeepAlive,
    Close,
}

async fn send(s: &mut BufStream<Conn>, frame: &PullResponseFrame) -> io::Result<()> {
    s.write_all(&frame.encode()).await?;
    s.flush().await
}

type Batch = Result<SharedBlocks, (Status, String)>;

/// Blocks `first .. first + count` of the lease, authenticated by the request's secret; any
/// failure is the one undifferentiated refusal ([`DENIED`]).
fn read_batch(ctx: &Ctx, req: &PullRequestFrame, first: usize, count: usize) -> Batch {
    match ctx
        .source
        .read_blocks(req.lease_id, &req.lease_secret, first, count)
    {
        Some(shared) if shared.len() == count => Ok(shared),
        _ => Err((Status::UnknownLease, DENIED.to_string())),
    }
}

/// Answer one pull: a refusal, or the header and the whole payload.
async fn serve_pull(
    s: &mut BufStream<Conn>,
    req: &PullRequestFrame,
    ctx: &Arc<Ctx>,
) -> io::Result<Next> {
    let started = Instant::now();
    let block_bytes = req.block_bytes;
    let refuse = |response: PullResponseFrame| {
        Counters::bump(&ctx.counters.pulls_refused, 1);
        ctx.transfers
            .record_failure(FailureReason::of_status(response.status));
        tracing::debug!(lease = req.lease_id, status = ?response.status, message = %response.message, "KV export: pull refused");
        response
    };
    // Nothing about this exporter is said before the lease is authenticated: these checks
    // are about the request's own numbers (and public limits).
    let range = usize::try_from(req.first_block)
        .ok()
        .zip(usize::try_from(req.count).ok())
        .filter(|(first, count)| first.checked_add(*count).is_some());
    let total = req.payload_bytes().filter(|&b| b <= MAX_PULL_BYTES);
    let fits = block_bytes <= u64::from(MAX_CHUNK_BYTES);
    let (Some((first, count)), Some(total), true) = (range, total, fits) else {
        let message = format!(
            "{} blocks of {} bytes from block {} is out of range (limit {MAX_PULL_BYTES} \
             bytes, {MAX_CHUNK_BYTES} per block)",
            req.count, req.block_bytes, req.first_block
        );
        send(
            s,
            &refuse(PullResponseFrame::refusal(Status::BadRequest, message)),
        )
        .await?;
        return Ok(Next::Close);
    };
    let per_batch = (ctx.config.batch_bytes / (block_bytes as usize).max(1)).max(1);
    let end = first + count;

    // The first batch authenticates the request (lease, secret, range) ...
    let mut next = first + count.min(per_batch);
    let mut current = match read_batch(ctx, req, first, next - first) {
        Ok(blocks) => blocks,
        Err((status, message)) => {
            send(s, &refuse(PullResponseFrame::refusal(status, message))).await?;
            return Ok(Next::KeepAlive);
        }
    };
    // ... and only then is the layout compared: the lease's holder may learn it.
    if req.fingerprint != ctx.fingerprint {
        drop(current);
        let mut refusal = PullResponseFrame::refusal(
            Status::FingerprintMismatch,
            format!(
                "layout fingerprint {} is not this exporter's {}",
                req.fingerprint, ctx.fingerprint
            ),
        );
        refusal.fingerprint = ctx.fingerprint;
        send(s, &refuse(refusal)).await?;
        return Ok(Next::KeepAlive);
    }
    if current.block_bytes() as u64 != block_bytes {
        let message = format!(
            "blocks hold {} bytes here, the request says {block_bytes}",
            current.block_bytes()
        );
        drop(current);
        send(
            s,
            &refuse(PullResponseFrame::refusal(Status::Length, message)),
        )
        .await?;
        return Ok(Next::KeepAlive);
    }
    let response = PullResponseFrame {
        status: Status::Ok,
        chunk_bytes: u32::try_from(block_bytes).unwrap_or(u32::MAX),
        fingerprint: ctx.fingerprint,
        lease_id: req.lease_id,
        first_block: req.first_block,
        count: req.count,
        block_bytes: req.block_bytes,
        message: String::new(),
    };
    s.write_all(&response.encode()).await?;
    loop {
        for (i, &sum) in current.checksums().iter().enumerate() {
            write_block(s, &current.block_pieces(i), sum).await?;
        }
        drop(current);
        if next >= end {
            break;
        }
        let n = (end - next).min(per_batch);
        let batch = read_batch(ctx, req, next, n);
        next += n;
        current = match batch {
            Ok(blocks) => blocks,
            Err((status, message)) => {
                Counters::bump(&ctx.counters.pulls_failed, 1);
                ctx.transfers
                    .record_failure(FailureReason::of_status(status));
                tracing::debug!(lease = req.lease_id, %message, "KV export: aborting a transfer");
                // Counted once, as this failure: a broken connection while writing the
                // abort changes nothing (the connection closes either way).
                let _ = write_abort(s, status, &message).await;
                return Ok(Next::Close);
            }
        };
    }
    s.flush().await?;
    Counters::bump(&ctx.counters.pulls_ok, 1);
    Counters::bump(&ctx.counters.bytes_sent, total);
    ctx.transfers.record_ok(total, started.elapsed());
    Ok(Next::KeepAlive)
}
