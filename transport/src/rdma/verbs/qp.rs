//! Reliable-connected queue pairs: create one, move it through INIT, RTR and RTS against a
//! peer's endpoint.

use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, GenericCompletionQueue};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
};

use super::device::RdmaDevice;
use super::verbs_error;
use crate::rdma::{LinkLayer, PathMtu, QpEndpoint, RdmaError};

/// A queue pair with its completion queue. The queue pair is dropped (destroyed) first, so
/// nothing completes into a destroyed queue.
pub(super) struct Connection {
    pub(super) qp: BasicQueuePair,
    pub(super) cq: Arc<BasicCompletionQueue>,
    pub(super) local: QpEndpoint,
}

fn verbs_mtu(m: PathMtu) -> Mtu {
    match m {
        PathMtu::Mtu256 => Mtu::Mtu256,
        PathMtu::Mtu512 => Mtu::Mtu512,
        PathMtu::Mtu1024 => Mtu::Mtu1024,
        PathMtu::Mtu2048 => Mtu::Mtu2048,
        PathMtu::Mtu4096 => Mtu::Mtu4096,
    }
}

/// A random 24-bit packet sequence number (from the process's hasher seed and the clock:
/// it only has to differ between connections, not be secret).
fn initial_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() as u32) & 0xff_ffff
}

impl Connection {
    /// A queue pair in INIT, with room for `depth` send work requests of up to `send_sge`
    /// scatter/gather entries each; `remote_read`: peers may READ this node's registered
    /// regions through it.
    pub(super) fn create(
        dev: &RdmaDevice,
        depth: u32,
        send_sge: u32,
        remote_read: bool,
    ) -> Result<Self, RdmaError> {
        let d = &dev.inner;
        let cq = d
            .ctx
            .create_cq_builder()
            .setup_cqe(depth.max(1) * 2)
            .build()
            .map_err(|e| verbs_error("ibv_create_cq", e))?;
        let mut qp =
            d.pd.create_qp_builder()
                .setup_qp_type(QueuePairType::ReliableConnection)
                .setup_send_cq(GenericCompletionQueue::from(Arc::clone(&cq)))
                .setup_recv_cq(GenericCompletionQueue::from(Arc::clone(&cq)))
                .setup_max_send_wr(depth.max(1))
                .setup_max_recv_wr(1)
                .setup_max_send_sge(send_sge.max(1))
                .setup_max_recv_sge(1)
                .build()
                .map_err(|e| verbs_error("ibv_create_qp", e))?;
        let access = if remote_read {
            AccessFlags::LocalWrite | AccessFlags::RemoteRead
        } else {
            AccessFlags::LocalWrite
        };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(d.port)
            .setup_access_flags(access);
        qp.modify(&attr)
            .map_err(|e| verbs_error("ibv_modify_qp(INIT)", e))?;
        let local = QpEndpoint {
            fabric: d.fabric,
            port: d.port,
            mtu: d.mtu,
            qpn: qp.qp_number(),
            psn: initial_psn(),
        };
        Ok(Self { qp, cq, local })
    }

    /// Move to RTR then RTS against `remote` (validated by its decoding).
    pub(super) fn connect(
        &mut self,
        dev: &RdmaDevice,
        remote: &QpEndpoint,
    ) -> Result<(), RdmaError> {
        if !self.local.fabric.common_with(&remote.fabric) {
            return Err(RdmaError::Connect {
                addr: remote.fabric.to_string(),
                message: format!("no common fabric with {}", self.local.fabric),
            });
        }
        let d = &dev.inner;
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.fabric.lid)
            .setup_port(d.port)
            .setup_service_level(0);
        // RoCE is always routed by GID; InfiniBand within one subnet by LID.
        if remote.fabric.link_layer == LinkLayer::Ethernet {
            ah.setup_grh_dest_gid(&Gid {
                raw: remote.fabric.gid,
            })
            .setup_grh_src_gid_index(u8::try_from(d.gid_index).unwrap_or(u8::MAX))
            .setup_grh_hop_limit(64);
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(verbs_mtu(self.local.mtu.min(remote.mtu)))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(d.rd_atomic)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        self.qp
            .modify(&attr)
            .map_err(|e| verbs_error("ibv_modify_qp(RTR)", e))?;
        let mut attr = QueuePairAttribute::new();
        // timeout 14: 4.096 us * 2^14 = 67 ms per retry, 7 retries: a dead peer is noticed
        // in about half a second, well within a transfer's deadline.
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(d.rd_atomic);
        self.qp
            .modify(&attr)
            .map_err(|e| verbs_error("ibv_modify_qp(RTS)", e))
    }
}
