//! Cache events on the wire (`CacheEvents`): the engine's [`Snapshot`] and [`EventBatch`]
//! to and from their messages, block hashes packed 16 bytes each (the u128 little-endian).
//! A message a node could not have sent (a hash list whose length is not a multiple of 16,
//! an unspecified tier or change) is refused whole, so a subscriber never applies half of it.

use pd_engine::kv::prefix::events::{CacheEvent, EventBatch, Snapshot, Tier};
use pd_engine::kv::prefix::hash::BlockHash;

use crate::pb;

/// Bytes of one packed hash.
pub const HASH_BYTES: usize = 16;

/// Why a cache-events message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MalformedEvents {
    #[error("a packed hash list of {0} bytes is not a whole number of 16-byte hashes")]
    PartialHash(usize),
    #[error("a cache event names no tier")]
    NoTier,
    #[error("a cache event names no change")]
    NoChange,
    #[error("a cache-events message carries neither a snapshot nor a batch")]
    Empty,
    #[error("a snapshot's capacity or block size does not fit this machine's integers")]
    TooLarge,
}

/// What one `CacheEventsMessage` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheMessage {
    Snapshot(Snapshot),
    Batch(EventBatch),
}

pub fn pack(hashes: &[BlockHash]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hashes.len() * HASH_BYTES);
    for h in hashes {
        out.extend_from_slice(&h.0.to_le_bytes());
    }
    out
}

pub fn unpack(bytes: &[u8]) -> Result<Vec<BlockHash>, MalformedEvents> {
    if !bytes.len().is_multiple_of(HASH_BYTES) {
        return Err(MalformedEvents::PartialHash(bytes.len()));
    }
    Ok(bytes
        .chunks_exact(HASH_BYTES)
        .map(|c| BlockHash(u128::from_le_bytes(c.try_into().expect("16 bytes"))))
        .collect())
}

fn wire_tier(t: Tier) -> pb::CacheTier {
    match t {
        Tier::Device => pb::CacheTier::Device,
        Tier::Host => pb::CacheTier::Host,
    }
}

fn tier(t: i32) -> Result<Tier, MalformedEvents> {
    match pb::CacheTier::try_from(t) {
        Ok(pb::CacheTier::Device) => Ok(Tier::Device),
        Ok(pb::CacheTier::Host) => Ok(Tier::Host),
        _ => Err(MalformedEvents::NoTier),
    }
}

fn wire_event(e: &CacheEvent) -> pb::CacheEvent {
    let (change, tier, hashes) = match e {
        CacheEvent::Stored { tier, hashes } => (pb::CacheChange::Stored, Some(*tier), &hashes[..]),
        CacheEvent::Removed { tier, hashes } => {
            (pb::CacheChange::Removed, Some(*tier), &hashes[..])
        }
        CacheEvent::Cleared => (pb::CacheChange::Cleared, None, &[][..]),
    };
    pb::CacheEvent {
        change: change as i32,
        tier: tier.map_or(pb::CacheTier::Unspecified, wire_tier) as i32,
        hashes: pack(hashes),
    }
}

fn event(e: &pb::CacheEvent) -> Result<CacheEvent, MalformedEvents> {
    match pb::CacheChange::try_from(e.change) {
        Ok(pb::CacheChange::Stored) => Ok(CacheEvent::Stored {
            tier: tier(e.tier)?,
            hashes: unpack(&e.hashes)?,
        }),
        Ok(pb::CacheChange::Removed) => Ok(CacheEvent::Removed {
            tier: tier(e.tier)?,
            hashes: unpack(&e.hashes)?,
        }),
        Ok(pb::CacheChange::Cleared) => Ok(CacheEvent::Cleared),
        _ => Err(MalformedEvents::NoChange),
    }
}

pub fn wire_snapshot(s: &Snapshot) -> pb::CacheEventsMessage {
    pb::CacheEventsMessage {
        kind: Some(pb::cache_events_message::Kind::Snapshot(
            pb::CacheSnapshot {
                epoch: s.epoch,
                seq: s.seq,
                block_size: u32::try_from(s.block_size).unwrap_or(u32::MAX),
                device_capacity: s.device_capacity as u64,
                host_capacity: s.host_capacity as u64,
                device_hashes: pack(&s.device),
                host_hashes: pack(&s.host),
            },
        )),
    }
}

pub fn wire_batch(b: &EventBatch) -> pb::CacheEventsMessage {
    pb::CacheEventsMessage {
        kind: Some(pb::cache_events_message::Kind::Batch(pb::CacheEventBatch {
            epoch: b.epoch,
            first_seq: b.first_seq,
            events: b.events.iter().map(wire_event).collect(),
        })),
    }
}

/// A received message, checked whole.
pub fn message(m: &pb::CacheEventsMessage) -> Result<CacheMessage, MalformedEvents> {
    let size = |v: u64| usize::try_from(v).map_err(|_| MalformedEvents::TooLarge);
    match &m.kind {
        Some(pb::cache_events_message::Kind::Snapshot(s)) => Ok(CacheMessage::Snapshot(Snapshot {
            epoch: s.epoch,
            seq: s.seq,
            block_size: s.block_size as usize,
            device_capacity: size(s.device_capacity)?,
            host_capacity: size(s.host_capacity)?,
            device: unpack(&s.device_hashes)?,
            host: unpack(&s.host_hashes)?,
        })),
        Some(pb::cache_events_message::Kind::Batch(b)) => Ok(CacheMessage::Batch(EventBatch {
            epoch: b.epoch,
            first_seq: b.first_seq,
            events: b.events.iter().map(event).collect::<Result<_, _>>()?,
        })),
        None => Err(MalformedEvents::Empty),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_and_batches_survive_the_wire_and_hashes_are_little_endian() {
        let big = BlockHash(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        assert_eq!(pack(&[big])[0], 0x10, "low byte first");
        let snap = Snapshot {
            epoch: 9,
            seq: 41,
            block_size: 16,
            device_capacity: 256,
            host_capacity: 0,
            device: vec![big, BlockHash(7)],
            host: vec![],
        };
        let m = wire_snapshot(&snap);
        assert_eq!(message(&m), Ok(CacheMessage::Snapshot(snap)));
        let batch = EventBatch {
            epoch: 9,
            first_seq: 42,
            events: vec![
                CacheEvent::Stored {
                    tier: Tier::Host,
                    hashes: vec![BlockHash(1)],
                },
                CacheEvent::Removed {
                    tier: Tier::Device,
                    hashes: vec![BlockHash(1), big],
                },
                CacheEvent::Cleared,
            ],
        };
        assert_eq!(message(&wire_batch(&batch)), Ok(CacheMessage::Batch(batch)));
    }

    #[test]
    fn a_message_no_node_could_send_is_refused_whole() {
        let mut m = wire_batch(&EventBatch {
            epoch: 1,
            first_seq: 1,
            events: vec![CacheEvent::Stored {
                tier: Tier::Device,
                hashes: vec![BlockHash(1)],
            }],
        });
        fn first_event(m: &mut pb::CacheEventsMessage) -> &mut pb::CacheEvent {
            match &mut m.kind {
                Some(pb::cache_events_message::Kind::Batch(b)) => &mut b.events[0],
                _ => unreachable!(),
            }
        }
        first_event(&mut m).hashes.pop();
        assert_eq!(message(&m), Err(MalformedEvents::PartialHash(15)));
        first_event(&mut m).hashes = vec![0; 16];
        first_event(&mut m).tier = 0;
        assert_eq!(message(&m), Err(MalformedEvents::NoTier));
        first_event(&mut m).change = 0;
        assert_eq!(message(&m), Err(MalformedEvents::NoChange));
        assert_eq!(
            message(&pb::CacheEventsMessage { kind: None }),
            Err(MalformedEvents::Empty)
        );
    }
}
