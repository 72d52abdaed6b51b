//! The RDMA types of a build without the `rdma` feature: they cannot be constructed
//! ([`RdmaDevice::open`] says why), so every method is unreachable by construction.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use super::{BoxFuture, Fabric, RdmaConfig, RdmaConnector, RdmaError, RdmaOffer};
use crate::{LayoutFingerprint, PullRequest};

/// An opened RDMA device (none in this build).
#[derive(Debug, Clone)]
pub struct RdmaDevice(Infallible);

impl RdmaDevice {
    /// Always [`RdmaError::NotBuilt`].
    pub fn open(_config: &RdmaConfig) -> Result<Self, RdmaError> {
        Err(RdmaError::NotBuilt)
    }

    pub fn fabric(&self) -> Fabric {
        match self.0 {}
    }

    pub fn describe(&self) -> String {
        match self.0 {}
    }
}

/// The prefill node's RDMA export (none in this build).
#[derive(Debug)]
pub struct RdmaExporter(Infallible);

impl RdmaExporter {
    pub fn new(device: &RdmaDevice, _connect_addr: String) -> Result<Self, RdmaError> {
        match device.0 {}
    }

    pub fn with_host_kv(
        self,
        _memory: Option<pd_engine::kv::handoff::placement::HostKvMemory>,
    ) -> Self {
        match self.0 {}
    }

    pub fn in_place(&self) -> bool {
        match self.0 {}
    }

    pub fn publish(
        &self,
        _lease_id: u64,
        _kv: &Arc<pd_engine::serve::LeasedKv>,
        _deadline: Instant,
    ) -> Result<(Vec<u8>, super::ExportMode), RdmaError> {
        match self.0 {}
    }

    pub fn retire(&self, _lease_id: u64) -> bool {
        match self.0 {}
    }

    pub fn retire_expired(&self, _now: Instant) -> usize {
        match self.0 {}
    }

    pub fn accept(&self, _endpoint: &[u8]) -> Result<Vec<u8>, RdmaError> {
        match self.0 {}
    }

    pub fn published(&self) -> usize {
        match self.0 {}
    }
}

/// The decode node's RDMA reader (none in this build).
#[derive(Debug)]
pub struct RdmaReader(Infallible);

impl RdmaReader {
    pub fn new(
        device: &RdmaDevice,
        _connector: Arc<dyn RdmaConnector>,
        _fingerprint: LayoutFingerprint,
        _config: &RdmaConfig,
    ) -> Result<Self, RdmaError> {
        match device.0 {}
    }

    pub fn with_host_kv(
        self,
        _memory: Option<pd_engine::kv::handoff::placement::HostKvMemory>,
    ) -> Self {
        match self.0 {}
    }

    pub fn lands_in_place(&self) -> bool {
        match self.0 {}
    }
}

impl crate::importer::OneSidedReader for RdmaReader {
    fn fabric(&self) -> Fabric {
        match self.0 {}
    }

    fn read<'a>(
        &'a self,
        _offer: &'a RdmaOffer,
        _req: PullRequest,
        _buffers: Option<&'a pd_engine::kv::handoff::block_buffers::BlockBuffers>,
        _deadline: Instant,
    ) -> BoxFuture<'a, Result<Vec<pd_engine::kv::handoff::host_buffer::HostBuffer>, RdmaError>>
    {
        match self.0 {}
    }
}
