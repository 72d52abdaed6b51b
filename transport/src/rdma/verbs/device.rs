//! Opening an RDMA device: which device, port and GID, and one protection domain.

use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{
    DeviceContext, LinkLayer as VerbsLinkLayer, Mtu, PortState,
};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::{chain, verbs_error};
use crate::rdma::{Fabric, LinkLayer, PathMtu, RdmaConfig, RdmaError};

/// An opened device port with its protection domain. Clones share it.
#[derive(Clone)]
pub struct RdmaDevice {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) name: String,
    pub(super) port: u8,
    pub(super) gid_index: u32,
    pub(super) fabric: Fabric,
    pub(super) mtu: PathMtu,
    /// Outstanding RDMA READs per queue pair, as initiator and as target: 16, or less where
    /// the device allows less.
    pub(super) rd_atomic: u8,
    /// Scatter/gather entries one RDMA READ may carry (and a reader's queue pair is made
    /// for): the device's `max_sge_rd`, within its `max_sge`.
    pub(super) read_sge: u32,
    /// Dropped before the context (field order).
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) ctx: Arc<DeviceContext>,
}

impl std::fmt::Debug for RdmaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

fn path_mtu(m: Mtu) -> PathMtu {
    match m {
        Mtu::Mtu256 => PathMtu::Mtu256,
        Mtu::Mtu512 => PathMtu::Mtu512,
        Mtu::Mtu1024 => PathMtu::Mtu1024,
        Mtu::Mtu2048 => PathMtu::Mtu2048,
        Mtu::Mtu4096 => PathMtu::Mtu4096,
    }
}

/// An IPv4-mapped GID (`::ffff:a.b.c.d`).
fn ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10..12] == [0xff, 0xff]
}

impl RdmaDevice {
    /// Open the device, port and GID `config` names, or the first usable ones.
    pub fn open(config: &RdmaConfig) -> Result<Self, RdmaError> {
        let list = DeviceList::new().map_err(|e| {
            RdmaError::Unavailable(format!("libibverbs cannot list devices: {}", chain(&e)))
        })?;
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        if names.is_empty() {
            return Err(RdmaError::Unavailable("no RDMA device on this host".into()));
        }
        if let Some(want) = &config.device
            && !names.contains(want)
        {
            return Err(RdmaError::Device {
                device: want.clone(),
                message: format!("not found; devices here: {}", names.join(", ")),
            });
        }
        let mut why_not = Vec::new();
        for device in list.iter() {
            let name = device.name();
            if config.device.as_ref().is_some_and(|want| *want != name) {
                continue;
            }
            let ctx = device
                .open()
                .map_err(|e| verbs_error("ibv_open_device", e))?;
            match Self::open_port(&name, ctx, config) {
                Ok(dev) => {
                    tracing::info!(device = %dev.describe(), "RDMA device opened");
                    return Ok(dev);
                }
                Err(e) => why_not.push(e.to_string()),
            }
        }
        Err(RdmaError::Unavailable(format!(
            "no usable RDMA port: {}",
            why_not.join("; ")
        )))
    }

    fn open_port(
        name: &str,
        ctx: Arc<DeviceContext>,
        config: &RdmaConfig,
    ) -> Result<Self, RdmaError> {
        let device_err = |message: String| RdmaError::Device {
            device: name.to_string(),
            message,
        };
        let dev_attr = ctx
            .query_device()
            .map_err(|e| verbs_error("ibv_query_device", e))?;
        let ports = dev_attr.phys_port_cnt();
        let rd_atomic = [
            16,
            dev_attr.max_qp_rd_atom(),
            dev_attr.max_qp_init_rd_atom(),
        ]
        .into_iter()
        .min()
        .unwrap_or(1)
        .clamp(1, 16) as u8;
        // A READ's local scatter list is bounded by `max_sge_rd`, and a queue pair's send
        // entries by `max_sge`; a device reporting 0 still takes one entry.
        let read_sge = dev_attr
            .max_sge_rd()
            .min(dev_attr.max_sge())
            .clamp(1, i32::MAX) as u32;
        let candidates: Vec<u8> = match config.port {
            Some(p) if p == 0 || p > ports => {
                return Err(device_err(format!("has ports 1..={ports}, not {p}")));
            }
            Some(p) => vec![p],
            None => (1..=ports).collect(),
        };
        let mut states = Vec::new();
        let mut chosen = None;
        for p in candidates {
            let attr = ctx
                .query_port(p)
                .map_err(|e| verbs_error("ibv_query_port", e))?;
            if attr.port_state() == PortState::Active {
                chosen = Some((p, attr));
                break;
            }
            states.push(format!("port {p} is {:?}", attr.port_state()));
        }
        let Some((port, attr)) = chosen else {
            return Err(device_err(format!(
                "no active port ({})",
                states.join(", ")
            )));
        };
        let link_layer = match attr.link_layer() {
            VerbsLinkLayer::Ethernet => LinkLayer::Ethernet,
            // Old InfiniBand drivers report "unspecified".
            VerbsLinkLayer::InfiniBand | VerbsLinkLayer::Unspecified => LinkLayer::InfiniBand,
        };
        let gid_index = match config.gid_index {
            Some(i) if i32::try_from(i).is_ok_and(|i| i < attr.gid_tbl_len()) => i,
            Some(i) => {
                return Err(device_err(format!(
                    "port {port} has GID indices 0..{}, not {i}",
                    attr.gid_tbl_len()
                )));
            }
            None => Self::pick_gid(&ctx, port, link_layer)?,
        };
        let gid = ctx
            .query_gid(port, gid_index)
            .map_err(|e| verbs_error("ibv_query_gid", e))?
            .raw;
        let fabric = Fabric {
            link_layer,
            lid: attr.lid(),
            gid,
        };
        fabric
            .validate()
            .map_err(|e| device_err(format!("port {port} GID index {gid_index}: {e}")))?;
        let pd = ctx.alloc_pd().map_err(|e| verbs_error("ibv_alloc_pd", e))?;
        Ok(Self {
            inner: Arc::new(Inner {
                name: name.to_string(),
                port,
                gid_index,
                fabric,
                mtu: path_mtu(attr.active_mtu()),
                rd_atomic,
                read_sge,
                pd,
                ctx,
            }),
        })
    }

    /// InfiniBand: index 0 (the port GID). Ethernet: the first RoCE v2 GID of an IPv4
    /// address, else the first RoCE v2 GID, else the first non-zero GID.
    fn pick_gid(ctx: &DeviceContext, port: u8, link: LinkLayer) -> Result<u32, RdmaError> {
        if link == LinkLayer::InfiniBand {
            return Ok(0);
        }
        let table = ctx
            .query_gid_table()
            .map_err(|e| verbs_error("ibv_query_gid_table", e))?;
        let ours: Vec<_> = table
            .iter()
            .filter(|e| e.port_num() == u32::from(port) && !e.gid().is_zero())
            .collect();
        let v2 = |e: &&&sideway::ibverbs::address::GidEntry| e.gid_type() == GidType::RoceV2;
        ours.iter()
            .filter(v2)
            .find(|e| ipv4_mapped(&e.gid().raw))
            .or_else(|| ours.iter().find(v2))
            .or_else(|| ours.first())
            .map(|e| e.gid_index())
            .ok_or_else(|| RdmaError::Device {
                device: format!("port {port}"),
                message: "no GID configured (give the interface an IP address)".into(),
            })
    }

    /// Scatter/gather entries one RDMA READ may carry on this device.
    pub(super) fn read_sge(&self) -> u32 {
        self.inner.read_sge
    }

    pub fn fabric(&self) -> crate::rdma::Fabric {
        self.inner.fabric
    }

    /// `mlx5_0 port 1 gid 3 (Ethernet (RoCE) lid 0x0 gid ...), MTU 4096`.
    pub fn describe(&self) -> String {
        let i = &self.inner;
        format!(
            "{} port {} GID index {} ({}), MTU {}",
            i.name,
            i.port,
            i.gid_index,
            i.fabric,
            i.mtu.bytes()
        )
    }

    /// Register `len` bytes at `ptr` for `access`.
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + len` must stay allocated and must not move until the returned region is
    /// dropped (and, for remote access, until no peer can use its rkey any more: dropping
    /// the region revokes it).
    pub(super) unsafe fn register(
        &self,
        ptr: *const u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<MemoryRegion>, RdmaError> {
        // SAFETY: the caller keeps the memory in place while the region lives.
        unsafe { self.inner.pd.reg_mr(ptr as usize, len, access) }
            .map_err(|e| verbs_error("ibv_reg_mr", e))
    }
}
