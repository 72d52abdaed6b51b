//! The import side: read a batch of leased blocks from an exporter, verified, before a
//! deadline.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_engine::kv::handoff::host_buffer::{HostBuffer, heap_buffer};
use pd_engine::kv::handoff::placement::KvReservation;
use pd_engine::serve::LeaseSecret;
use pd_tls::{ClientTls, Conn};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;

use crate::chunks::{BlockReader, PullIdentity, status_error};
use crate::error::TransportError;
use crate::fingerprint::LayoutFingerprint;
use crate::stats::TransferStats;
use crate::wire::{
    FRAME_HEADER_LEN, FrameHeader, FrameKind, MAX_MESSAGE_LEN, MAX_PULL_BYTES,
    PULL_RESPONSE_BODY_LEN, PullRequestFrame, PullResponseFrame, Status, VERSION,
};

/// One read: blocks `first_block .. first_block + count` of lease `lease_id` on the exporter,
/// each `block_bytes` bytes, from an exporter whose layout fingerprint is `fingerprint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullRequest {
    pub lease_id: u64,
    /// The lease's secret (the `KvHandle`'s): the exporter serves nothing without it.
    pub lease_secret: LeaseSecret,
    pub fingerprint: LayoutFingerprint,
    pub first_block: usize,
    pub count: usize,
    /// Bytes per block ([`pd_engine::kv::KvLayout::block_bytes`]).
    pub block_bytes: usize,
}

impl PullRequest {
    /// Payload bytes of this read (`None` on overflow).
    pub fn payload_bytes(&self) -> Option<u64> {
        (self.count as u64).checked_mul(self.block_bytes as u64)
    }
}

/// Read `req`'s blocks from the exporter at `addr` over a new connection, verified (length,
/// fingerprint, checksums), or fail with a typed error once `deadline` passes.
pub async fn pull_blocks(
    addr: SocketAddr,
    req: PullRequest,
    deadline: Instant,
) -> Result<Vec<HostBuffer>, TransportError> {
    let mut conn = connect(addr, deadline, None).await?;
    let mut started = false;
    let mut sink = Sink::Buffers {
        pool: None,
        blocks: Vec::new(),
    };
    transfer(addr, &mut conn, &req, deadline, &mut started, &mut sink).await?;
    Ok(sink.into_blocks())
}

/// Where a pull's blocks go.
enum Sink<'a> {
    /// Into buffers (from `pool` when given), collected in `blocks`.
    Buffers {
        pool: Option<&'a BlockBuffers>,
        blocks: Vec<HostBuffer>,
    },
    /// In place, into the KV memory the engine reserved.
    Placed(&'a mut KvReservation),
}

impl Sink<'_> {
    fn into_blocks(self) -> Vec<HostBuffer> {
        match self {
            Sink::Buffers { blocks, .. } => blocks,
            Sink::Placed(_) => Vec::new(),
        }
    }

    /// Read the pull's `count` blocks through `reader`. Buffers of a failed pull go back to
    /// their pool.
    async fn read_all<R: AsyncRead + Unpin>(
        &mut self,
        conn: &mut R,
        reader: &mut BlockReader,
        req: &PullRequest,
    ) -> Result<(), TransportError> {
        match self {
            Sink::Buffers { pool, blocks } => {
                let pool = pool.filter(|b| b.block_bytes() == req.block_bytes);
                *blocks = match pool {
                    Some(p) => take_buffers(p, req.count).await?,
                    None => (0..req.count)
                        .map(|_| heap_buffer(req.block_bytes))
                        .collect(),
                };
                for block in blocks.iter_mut() {
                    if let Err(e) = reader.read_block(conn, block.as_bytes_mut()).await {
                        if let Some(p) = pool {
                            p.give_all(std::mem::take(blocks));
                        }
                        return Err(e);
                    }
                }
                Ok(())
            }
            Sink::Placed(r) => {
                for i in 0..req.count {
                    reader.read_block_into(conn, &mut r.block_mut(i)).await?;
                }
                Ok(())
            }
        }
    }
}

/// `n` buffers from `pool`: its spares, and new ones allocated on a blocking thread, since
/// a GPU node's allocator page-locks memory (milliseconds per block on a cold pool) and must
/// not hold a runtime thread that other requests' streams run on.
async fn take_buffers(pool: &BlockBuffers, n: usize) -> Result<Vec<HostBuffer>, TransportError> {
    let mut got = pool.take_spare(n);
    let missing = n - got.len();
    if missing > 0 {
        let p = pool.clone();
        let fresh = tokio::task::spawn_blocking(move || p.allocate(missing))
            .await
            .map_err(|e| {
                pool.give_all(std::mem::take(&mut got));
                TransportError::Io(std::io::Error::other(format!(
                    "allocating {missing} buffers for the pulled blocks failed: {e}"
                )))
            })?;
        got.extend(fresh);
    }
    Ok(got)
}

/// Connections kept open between pulls, per exporter: a pull reuses an idle connection when
/// one is there (and retries once on a fresh connection if the idle one turns out closed
/// before any answer arrived). Every pull is counted in the puller's [`TransferStats`]. Clones
/// share the pool and the counters.
///
/// Blocks arrive in buffers from [`KvPuller::with_buffers`]'s [`BlockBuffers`] when their
/// length matches (the decode engine gives them back once copied into KV storage), else in
/// new ones.
#[derive(Clone, Default)]
pub struct KvPuller {
    idle: Arc<Mutex<HashMap<SocketAddr, Vec<IdleConn>>>>,
    stats: Arc<TransferStats>,
    buffers: Option<BlockBuffers>,
    /// TLS for new connections (`--tls-ca`; this node's certificate as client identity).
    tls: Option<ClientTls>,
}

struct IdleConn {
    conn: BufStream<Conn>,
    since: Instant,
}

impl std::fmt::Debug for KvPuller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle: usize = self
            .idle
            .lock()
            .map(|m| m.values().map(Vec::len).sum())
            .unwrap_or(0);
        f.debug_struct("KvPuller").field("idle", &idle).finish()
    }
}

/// Idle connections kept per exporter.
const MAX_IDLE_PER_PEER: usize = 8;
/// An idle connection older than this is closed rather than reused (the exporter closes
/// after 60 s by default).
const MAX_IDLE_AGE: Duration = Duration::from_secs(30);

impl KvPuller {
    pub fn new() -> Self {
        Self::default()
    }

    /// A puller whose blocks arrive in `buffers` (see the type's documentation).
    pub fn with_buffers(buffers: BlockBuffers) -> Self {
        Self {
            buffers: Some(buffers),
            ..Self::default()
        }
    }

    /// This puller, dialing with TLS when `tls` is given (new connections from now on).
    pub fn with_tls(mut self, tls: Option<ClientTls>) -> Self {
        self.tls = tls;
        self
    }

    /// The buffers pulled blocks arrive in, if set ([`KvPuller::with_buffers`]).
    pub(crate) fn buffers(&self) -> Option<&BlockBuffers> {
        self.buffers.as_ref()
    }

    /// The counters of this puller's transfers (completed and failed).
    pub fn stats(&self) -> &Arc<TransferStats> {
        &self.stats
    }

    /// [`pull_blocks`] over a pooled connection, counted in [`KvPuller::stats`].
    pub async fn pull(
        &self,
        addr: SocketAddr,
        req: PullRequest,
        deadline: Instant,
    ) -> Result<Vec<HostBuffer>, TransportError> {
        let mut sink = Sink::Buffers {
            pool: self.buffers.as_ref(),
            blocks: Vec::new(),
        };
        self.pull_counted(addr, req, deadline, &mut sink).await?;
        Ok(sink.into_blocks())
    }

    /// The same pull, landing in place in `into` (the blocks the decode engine reserved for
    /// it: `req.count` blocks of `req.block_bytes` bytes, checked before anything is sent).
    /// On failure `into` holds partial data and must not be admitted.
    pub async fn pull_into(
        &self,
        addr: SocketAddr,
        req: PullRequest,
        into: &mut KvReservation,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        check_reservation(&req, into)?;
        self.pull_counted(addr, req, deadline, &mut Sink::Placed(into))
            .await
    }

    async fn pull_counted(
        &self,
        addr: SocketAddr,
        req: PullRequest,
        deadline: Instant,
        sink: &mut Sink<'_>,
    ) -> Result<(), TransportError> {
        let started = Instant::now();
        let result = self.pull_pooled(addr, req, deadline, sink).await;
        match &result {
            Ok(()) => self
                .stats
                .record_ok(req.payload_bytes().unwrap_or(0), started.elapsed()),
            Err(e) => self.stats.record_failure(e.reason()),
        }
        result
    }

    async fn pull_pooled(
        &self,
        addr: SocketAddr,
        req: PullRequest,
        deadline: Instant,
        sink: &mut Sink<'_>,
    ) -> Result<(), TransportError> {
        if let Some(mut conn) = self.take_idle(addr) {
            let mut started = false;
            match transfer(addr, &mut conn, &req, deadline, &mut started, sink).await {
                Ok(()) => {
                    self.put_idle(addr, conn);
                    return Ok(());
                }
                // The exporter closed the idle connection: nothing was read, try a fresh one.
                Err(TransportError::Io(e)) if !started => {
                    tracing::debug!(%addr, error = %e, "stale pooled KV connection; reconnecting");
                }
                Err(e) => return Err(e),
            }
        }
        let mut conn = connect(addr, deadline, self.tls.as_ref()).await?;
        let mut started = false;
        transfer(addr, &mut conn, &req, deadline, &mut started, sink).await?;
        self.put_idle(addr, conn);
        Ok(())
    }

    /// Idle connections currently held for `addr`.
    pub fn idle_connections(&self, addr: SocketAddr) -> usize {
        self.idle
            .lock()
            .map(|m| m.get(&addr).map_or(0, Vec::len))
            .unwrap_or(0)
    }

    fn take_idle(&self, addr: SocketAddr) -> Option<BufStream<Conn>> {
        let mut idle = self.idle.lock().ok()?;
        let conns = idle.get_mut(&addr)?;
        conns.retain(|c| c.since.elapsed() < MAX_IDLE_AGE);
        conns.pop().map(|c| c.conn)
    }

    fn put_idle(&self, addr: SocketAddr, conn: BufStream<Conn>) {
        if let Ok(mut idle) = self.idle.lock() {
            let conns = idle.entry(addr).or_default();
            if conns.len() < MAX_IDLE_PER_PEER {
                conns.push(IdleConn {
                    conn,
                    since: Instant::now(),
                });
            }
        }
    }
}

async fn connect(
    addr: SocketAddr,
    deadline: Instant,
    tls: Option<&ClientTls>,
) -> Result<BufStream<Conn>, TransportError> {
    let expired = || TransportError::Deadline {
        addr,
        stage: "connecting",
    };
    if Instant::now() >= deadline {
        return Err(expired());
    }
    let stream = tokio::time::timeout_at(deadline.into(), TcpStream::connect(addr))
        .await
        .map_err(|_| expired())?
        .map_err(|source| TransportError::Connect { addr, source })?;
    let _ = stream.set_nodelay(true);
    let conn = match tls {
        // The exporter's certificate must name its IP (or --tls-server-name).
        Some(tls) => {
            tokio::time::timeout_at(deadline.into(), tls.connect(stream, &addr.ip().to_string()))
                .await
                .map_err(|_| expired())?
                .map_err(|source| TransportError::Connect { addr, source })?
        }
        None => Conn::Plain(stream),
    };
    Ok(BufStream::with_capacity(4 << 10, 4 << 10, conn))
}

/// One request/response on an open connection, bounded by `deadline`. `started` turns true
/// once the response header arrived.
async fn transfer(
    addr: SocketAddr,
    conn: &mut BufStream<Conn>,
    req: &PullRequest,
    deadline: Instant,
    started: &mut bool,
    sink: &mut Sink<'_>,
) -> Result<(), TransportError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(TransportError::Deadline {
            addr,
            stage: "transferring",
        });
    }
    let timeout_ms = u32::try_from(left.as_millis().max(1)).unwrap_or(u32::MAX);
    let exchanged = exchange(conn, req, timeout_ms, started, sink);
    tokio::time::timeout_at(deadline.into(), exchanged)
        .await
        .unwrap_or(Err(TransportError::Deadline {
            addr,
            stage: "transferring",
        }))
}

async fn exchange(
    conn: &mut BufStream<Conn>,
    req: &PullRequest,
    timeout_ms: u32,
    started: &mut bool,
    sink: &mut Sink<'_>,
) -> Result<(), TransportError> {
    req.payload_bytes()
        .filter(|&b| b <= MAX_PULL_BYTES)
        .ok_or_else(|| {
            TransportError::Length(format!(
                "{} blocks of {} bytes exceed the {MAX_PULL_BYTES}-byte limit of one pull",
                req.count, req.block_bytes
            ))
        })?;
    let frame = PullRequestFrame {
        lease_id: req.lease_id,
        lease_secret: req.lease_secret,
        fingerprint: req.fingerprint,
        first_block: req.first_block as u64,
        count: req.count as u64,
        block_bytes: req.block_bytes as u64,
        timeout_ms,
    };
    conn.write_all(&frame.encode()).await?;
    conn.flush().await?;
    read_reply(conn, req, started, sink).await
}

/// Reads the exporter's reply to `req` (response frame and, on OK, every block, verified:
/// lengths, echoes, fingerprint, checksums) from `r`, exactly as a pull reads it from its
/// connection, into one heap buffer per block. The importer's whole decoding of what an
/// exporter sends, without a socket: for tests and fuzzing of that path. The caller bounds
/// `req.count * req.block_bytes` (the buffers are allocated before the payload is read).
pub async fn read_pull_reply<R: AsyncRead + Unpin>(
    r: &mut R,
    req: &PullRequest,
) -> Result<Vec<HostBuffer>, TransportError> {
    let mut started = false;
    let mut sink = Sink::Buffers {
        pool: None,
        blocks: Vec::new(),
    };
    read_reply(r, req, &mut started, &mut sink).await?;
    Ok(sink.into_blocks())
}

/// The reply half of [`exchange`]: `started` turns true once the response header arrived.
async fn read_reply<R: AsyncRead + Unpin>(
    conn: &mut R,
    req: &PullRequest,
    started: &mut bool,
    sink: &mut Sink<'_>,
) -> Result<(), TransportError> {
    let total = req.payload_bytes().unwrap_or(u64::MAX);
    let mut head = [0u8; FRAME_HEADER_LEN];
    conn.read_exact(&mut head).await?;
    *started = true;
    let header = FrameHeader::decode(&head).map_err(protocol)?;
    if header.version != VERSION || header.kind != FrameKind::PullResponse as u16 {
        return Err(TransportError::Protocol(format!(
            "expected a version {VERSION} pull response, got version {} kind {}",
            header.version, header.kind
        )));
    }
    let body_len = header.body_len as usize;
    if !(PULL_RESPONSE_BODY_LEN..=PULL_RESPONSE_BODY_LEN + MAX_MESSAGE_LEN).contains(&body_len) {
        return Err(TransportError::Protocol(format!(
            "pull response body of {body_len} bytes"
        )));
    }
    let mut body = [0u8; PULL_RESPONSE_BODY_LEN];
    conn.read_exact(&mut body).await?;
    let (mut resp, msg_len) = PullResponseFrame::decode_body(&body).map_err(protocol)?;
    if msg_len != body_len - PULL_RESPONSE_BODY_LEN {
        return Err(TransportError::Protocol(format!(
            "message length {msg_len} disagrees with the body length {body_len}"
        )));
    }
    let mut msg = vec![0u8; msg_len];
    conn.read_exact(&mut msg).await?;
    resp.message = String::from_utf8_lossy(&msg).into_owned();

    let id = PullIdentity {
        lease_id: req.lease_id,
        first_block: req.first_block as u64,
        count: req.count as u64,
    };
    // A refusal carries the exporter's fingerprint only where it authenticated the lease
    // (FINGERPRINT_MISMATCH); an OK must carry ours.
    if resp.status == Status::FingerprintMismatch
        || (resp.status == Status::Ok && resp.fingerprint != req.fingerprint)
    {
        return Err(TransportError::FingerprintMismatch {
            ours: req.fingerprint,
            theirs: resp.fingerprint,
        });
    }
    if resp.status != Status::Ok {
        return Err(status_error(resp.status, resp.message, id));
    }
    if (resp.lease_id, resp.first_block) != (id.lease_id, id.first_block) {
        return Err(TransportError::Protocol(format!(
            "the exporter answered lease {} from block {}, we asked for lease {} from block {}",
            resp.lease_id, resp.first_block, id.lease_id, id.first_block
        )));
    }
    if (resp.count, resp.block_bytes) != (id.count, req.block_bytes as u64) {
        return Err(TransportError::Length(format!(
            "the exporter announced {} blocks of {} bytes, we asked for {} of {}",
            resp.count, resp.block_bytes, req.count, req.block_bytes
        )));
    }
    let block_bytes = req.block_bytes as u64;
    if total > 0 && u64::from(resp.chunk_bytes) != block_bytes {
        return Err(TransportError::Protocol(format!(
            "chunks of {} bytes announced; a chunk is one block of {block_bytes} bytes",
            resp.chunk_bytes
        )));
    }

    let mut reader = BlockReader::new(block_bytes, id);
    sink.read_all(conn, &mut reader, req).await
}

/// A reservation fits a pull: as many blocks, of as many bytes.
pub(crate) fn check_reservation(
    req: &PullRequest,
    into: &KvReservation,
) -> Result<(), TransportError> {
    if into.len() != req.count || into.block_bytes() != req.block_bytes {
        return Err(TransportError::Length(format!(
            "the KV reserved for this pull holds {} blocks of {} bytes; the pull reads {} of {}",
            into.len(),
            into.block_bytes(),
            req.count,
            req.block_bytes
        )));
    }
    Ok(())
}

fn protocol(e: crate::wire::WireError) -> TransportError {
    TransportError::Protocol(e.to_string())
}
