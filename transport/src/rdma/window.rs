//! The in-flight window of one transfer's READs, and its completion bookkeeping.
//!
//! A send queue holds a bounded number of work requests and an HCA serves a bounded number
//! of outstanding RDMA READs per queue pair, so a transfer posts its operations in batches
//! that keep at most `max_in_flight` outstanding, and posts more as completions come back.
//! Every work request id carries the transfer's tag and the operation's index, so a
//! completion is matched to its operation; a completion for another transfer, for an
//! operation not posted, or a second one for the same operation is a protocol error (the
//! queue pair is then torn down rather than trusted).

use std::ops::Range;

/// Default bound of outstanding READs per queue pair (HCAs allow 16 or more outstanding
/// reads per QP as initiator; more queue in the send queue).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 16;

/// A completion that does not fit the window.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompletionError {
    #[error("completion for transfer tag {got}, this transfer is {want}")]
    OtherTransfer { got: u32, want: u32 },
    #[error("completion for operation {0}, which was never posted")]
    NotPosted(u32),
    #[error("second completion for operation {0}")]
    Duplicate(u32),
}

/// Which operations of a transfer are posted and completed.
#[derive(Debug, Clone)]
pub struct ReadWindow {
    tag: u32,
    max_in_flight: usize,
    /// Operations posted so far (`0..posted`).
    posted: usize,
    completed: Vec<bool>,
    done: usize,
}

impl ReadWindow {
    /// A window over `ops` operations of the transfer `tag`.
    pub fn new(tag: u32, ops: usize, max_in_flight: usize) -> Self {
        Self {
            tag,
            max_in_flight: max_in_flight.max(1),
            posted: 0,
            completed: vec![false; ops],
            done: 0,
        }
    }

    /// The work request id of operation `index`.
    pub fn wr_id(&self, index: usize) -> u64 {
        (u64::from(self.tag) << 32) | index as u64
    }

    pub fn in_flight(&self) -> usize {
        self.posted - self.done
    }

    /// The operations to post now (possibly none); call [`ReadWindow::posted`] once they are.
    pub fn next_batch(&self) -> Range<usize> {
        let room = self.max_in_flight - self.in_flight();
        self.posted..(self.posted + room).min(self.completed.len())
    }

    /// The batch returned by [`ReadWindow::next_batch`] was posted.
    pub fn posted(&mut self, batch: Range<usize>) {
        debug_assert_eq!(batch.start, self.posted);
        self.posted = batch.end.min(self.completed.len());
    }

    /// A successful completion with work request id `wr_id` arrived.
    pub fn complete(&mut self, wr_id: u64) -> Result<(), CompletionError> {
        let tag = (wr_id >> 32) as u32;
        let index = wr_id as u32;
        if tag != self.tag {
            return Err(CompletionError::OtherTransfer {
                got: tag,
                want: self.tag,
            });
        }
        if index as usize >= self.posted {
            return Err(CompletionError::NotPosted(index));
        }
        let slot = &mut self.completed[index as usize];
        if *slot {
            return Err(CompletionError::Duplicate(index));
        }
        *slot = true;
        self.done += 1;
        Ok(())
    }

    /// Operations completed so far.
    pub fn completed(&self) -> usize {
        self.done
    }

    /// Every operation completed.
    pub fn is_done(&self) -> bool {
        self.done == self.completed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn posts_in_batches_bounded_by_the_window() {
        let mut w = ReadWindow::new(7, 5, 2);
        assert_eq!(w.next_batch(), 0..2);
        w.posted(0..2);
        assert_eq!(w.next_batch(), 2..2, "full");
        w.complete(w.wr_id(1)).unwrap();
        assert_eq!(w.next_batch(), 2..3);
        w.posted(2..3);
        w.complete(w.wr_id(0)).unwrap();
        w.complete(w.wr_id(2)).unwrap();
        assert_eq!(w.next_batch(), 3..5);
        w.posted(3..5);
        w.complete(w.wr_id(4)).unwrap();
        assert!(!w.is_done());
        w.complete(w.wr_id(3)).unwrap();
        assert!(w.is_done());
        assert_eq!(w.next_batch(), 5..5);
    }

    #[test]
    fn foreign_unposted_and_repeated_completions_are_errors() {
        let mut w = ReadWindow::new(7, 3, 8);
        w.posted(0..2);
        let other = ReadWindow::new(8, 3, 8);
        assert_eq!(
            w.complete(other.wr_id(0)),
            Err(CompletionError::OtherTransfer { got: 8, want: 7 })
        );
        assert_eq!(w.complete(w.wr_id(2)), Err(CompletionError::NotPosted(2)));
        w.complete(w.wr_id(1)).unwrap();
        assert_eq!(w.complete(w.wr_id(1)), Err(CompletionError::Duplicate(1)));
        assert_eq!(w.in_flight(), 1);
    }

    #[test]
    fn an_empty_transfer_is_done_at_once() {
        let w = ReadWindow::new(1, 0, 4);
        assert!(w.is_done());
        assert_eq!(w.next_batch(), 0..0);
    }

    proptest! {
        /// Whatever order completions come in, the window never exceeds its bound, posts
        /// every operation once, and is done exactly when all completed.
        #[test]
        fn any_completion_order_keeps_the_bound(
            ops in 0usize..200,
            max in 1usize..20,
            picks in proptest::collection::vec(any::<proptest::sample::Index>(), 0..400),
        ) {
            let mut w = ReadWindow::new(3, ops, max);
            let mut outstanding: Vec<usize> = Vec::new();
            let mut posted_total = 0;
            let mut picks = picks.into_iter();
            loop {
                let batch = w.next_batch();
                posted_total += batch.len();
                outstanding.extend(batch.clone());
                w.posted(batch);
                prop_assert!(w.in_flight() <= max);
                prop_assert_eq!(w.in_flight(), outstanding.len());
                if outstanding.is_empty() {
                    break;
                }
                let i = picks.next().map_or(0, |p| p.index(outstanding.len()));
                let op = outstanding.swap_remove(i);
                w.complete(w.wr_id(op)).unwrap();
            }
            prop_assert!(w.is_done());
            prop_assert_eq!(posted_total, ops);
        }
    }
}
